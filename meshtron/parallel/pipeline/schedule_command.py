"""``meshtron schedule``: one pipeline schedule as a table, its bubble (theory and simulation),
its peak in-flight micro-batches and a timeline PNG, without training anything.

The schedules and the timeline (torch-free, but matplotlib) are imported only once the command
runs (``meshtron --help`` builds this parser)."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshtron.errors import MeshtronError
from meshtron.files import png_path

SCHEDULE_LIMITS = {"pp": 256, "vpp": 16, "microbatches": 4096}
"""What `meshtron schedule` simulates and draws (larger tables take minutes and gigabytes)."""


def add_schedule_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("schedule", help="show a pipeline schedule, its bubble, and a timeline PNG")
    p.add_argument("--schedule", default="1f1b",
                   help="gpipe, 1f1b, interleaved, zb-h1 or zb-v")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages (default 4)")
    p.add_argument("--vpp", type=int, default=1,
                   help="model chunks per stage: >= 2 for interleaved, 2 for zb-v (default 1)")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    p.add_argument("--out", help="PNG path (default: ./schedule-S-ppP-vppV-mM.png)")
    p.set_defaults(func=run_schedule)
    return p


def _check_size(args: argparse.Namespace) -> None:
    """Refuse, in one line, a table too large to simulate and draw in reasonable time."""
    for name, limit in SCHEDULE_LIMITS.items():
        if getattr(args, name) > limit:
            raise MeshtronError(f"--{name} {getattr(args, name)} is beyond what `meshtron "
                                f"schedule` simulates and draws (at most {limit})")
    if args.pp * args.vpp * args.microbatches > 65536:
        raise MeshtronError(f"--pp x --vpp x --microbatches = "
                            f"{args.pp * args.vpp * args.microbatches} actions per pass is beyond "
                            "what `meshtron schedule` simulates and draws (at most 65536)")


def run_schedule(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise MeshtronError(f"unrecognised argument '{extra[0]}'")
    from meshtron.parallel.pipeline.schedules import COMM_KINDS, build_schedule
    from meshtron.parallel.pipeline.timeline import plot_schedule

    _check_size(args)
    schedule = build_schedule(args.schedule, args.pp, args.vpp, args.microbatches)
    print(f"schedule {schedule.name}: pp={schedule.pp} vpp={schedule.vpp} "
          f"micro-batches={schedule.microbatches}")
    print("\n".join(schedule.table()))
    comm = [a for row in schedule.stages for a in row if a.kind in COMM_KINDS]
    sends = sum(a.kind.startswith("SEND") for a in comm)
    print(f"communication: {sends} sends and {len(comm) - sends} receive posts "
          f"(not shown above), each posted {schedule.receives_ahead} ahead")
    costs = ", ".join(f"{k}={v:g}" for k, v in schedule.default_costs().items())
    print(f"bubble fraction ({costs}): theory {schedule.theoretical_bubble():.4f}, "
          f"simulated {schedule.bubble_fraction():.4f}")
    unit = "(micro-batch, chunk) pairs" if schedule.vpp > 1 else "micro-batches"
    print(f"peak in-flight {unit} per stage: "
          + " ".join(str(n) for n in schedule.peak_in_flight()))
    default = (f"schedule-{schedule.name}-pp{schedule.pp}-vpp{schedule.vpp}"
               f"-m{schedule.microbatches}.png")
    out = png_path(args.out, default) if args.out else Path(default)
    print(f"timeline: {plot_schedule(schedule, out)}")
    return 0
