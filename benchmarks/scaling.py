"""How cost grows: step time and memory against model size, sequence length (without and with
full recompute) and micro-batch count, each curve set beside its formula.

Run from the repository root::

    .venv/bin/python benchmarks/scaling.py [--steps N] [--warmup N] [--threads T]
        [--configs SWEEP ...] [--json OUT] [--plot PNG] [--quick]

Every point is one shape of meshtron's training step (``scaling_point.py``: ``train_step`` on
one process, fp32, AdamW). One spawned process times every point, one after the other, on
glibc's default heap; a second, started on the exact heap, measures their memory. The sweeps:

- ``model-size``: llamas of 4 x 256 (the tiny preset's shape), 6 x 384, 8 x 512, 10 x 640 and
  12 x 768 blocks x width (7M to 97M parameters with an 8192-token vocabulary), 2 sequences of
  256 tokens per step;
- ``seq-none`` and ``seq-full``: the 8 x 512 model at 128 to 1024 tokens per sequence, 1024
  tokens per step, without and with full recompute;
- ``micro-batches``: the 8 x 512 model, 1 to 8 micro-batches of 2 x 256 tokens per step.

Each measured quantity q has a formula f (FLOPs, bytes, or the unit the work scales with: see
``scaling_point.py``). Along a sweep the benchmark reports q's *growth against its formula*,
g = (q_last / f_last) / (q_first / f_first) (1: it grows as its formula says; above 1: faster),
and, where f changes by 1.5x or more, the exponent k of q ~ f^k over the sweep's ends. A term
is named as growing faster than its formula when g > 1 + ``--tolerance`` and, for a time
class, it holds at least 5% of the last point's step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import harness
from scaling_point import TIME_CLASSES, Shape, llama, measure_memory, measure_time

WIDE = llama(8, 512)
SWEEPS: dict[str, list[Shape]] = {
    "model-size": [Shape(f"{n}x{h}", llama(n, h), seq=256, micro_batch=2)
                   for n, h in ((4, 256), (6, 384), (8, 512), (10, 640), (12, 768))],
    **{f"seq-{mode}": [Shape(f"seq {s}", WIDE, seq=s, micro_batch=1024 // s, recompute=mode)
                       for s in (128, 256, 512, 1024)] for mode in ("none", "full")},
    "micro-batches": [Shape(f"{m} micro-batches", WIDE, seq=256, micro_batch=2, micro_batches=m)
                      for m in (1, 2, 4, 8)],
}
SMALL = llama(2, 128)
QUICK: dict[str, list[Shape]] = {
    "model-size": [Shape(f"{n}x{h}", llama(n, h), seq=64, micro_batch=2)
                   for n, h in ((2, 128), (4, 256))],
    **{f"seq-{mode}": [Shape(f"seq {s}", SMALL, seq=s, micro_batch=256 // s, recompute=mode)
                       for s in (64, 128)] for mode in ("none", "full")},
    "micro-batches": [Shape(f"{m} micro-batches", SMALL, seq=64, micro_batch=2, micro_batches=m)
                      for m in (1, 2)],
}
MEMORY_TERMS = ("peak_bytes", "step_bytes", "saved_bytes")
SHARE_TO_NAME = 0.05
MiB = 2 ** 20


def time_points(rank: int, world: int, shapes: list[Shape], steps: int, warmup: int,
                threads: int) -> list[dict[str, Any]]:
    """The timing process: every point, one after the other."""
    import torch

    torch.set_num_threads(threads)
    return [measure_time(shape, steps, warmup) for shape in shapes]


def memory_points(rank: int, world: int, shapes: list[Shape],
                  threads: int) -> list[dict[str, Any]]:
    """The memory process (exact heap): every point, after one unrecorded run of the first (a
    process's first model leaves one-off allocations behind: kernels' workspaces) so that it
    does not count in the first point's memory."""
    import torch

    torch.set_num_threads(threads)
    measure_memory(shapes[0])
    return [measure_memory(shape) for shape in shapes]


def term_values(point: dict[str, Any], term: str) -> tuple[float | None, float]:
    """(measured, formula) of one term at one point: ``step_time`` (against the model's FLOPs),
    a time class or a memory term."""
    formula = point["formula"]
    if term == "step_time":
        return point["median_s"], formula["model_flops"]
    if term in TIME_CLASSES:
        return point["class_s"][term], formula[term]
    return point[term], formula[term]


def growth(points: Sequence[dict[str, Any]], term: str, tolerance: float) -> dict[str, Any] | None:
    """The term's growth against its formula over the sweep (see the module docstring); None
    where it was not measured at both ends."""
    (q0, f0), (q1, f1) = term_values(points[0], term), term_values(points[-1], term)
    if not q0 or not q1:
        return None
    g = (q1 / f1) / (q0 / f0)
    k = math.log(q1 / q0) / math.log(f1 / f0) if max(f1 / f0, f0 / f1) >= 1.5 else None
    share = q1 / points[-1]["median_s"] if term in TIME_CLASSES else 1.0
    faster = g > 1 + tolerance and share >= SHARE_TO_NAME
    verdict = ("faster than its formula" if faster else
               "slower than its formula" if g < 1 / (1 + tolerance) else "as its formula")
    return {"term": term, "growth": g, "exponent": k, "share": share, "verdict": verdict}


def growth_table(points: Sequence[dict[str, Any]], tolerance: float) -> list[dict[str, Any]]:
    terms = ("step_time", *TIME_CLASSES, *MEMORY_TERMS)
    return [row for t in terms if (row := growth(points, t, tolerance)) is not None]


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MiB:.0f}"


def points_table(points: Sequence[dict[str, Any]]) -> str:
    header = ["point", "params", "tokens", "step s", "tok/s", "GFLOP/s",
              *(f"{c} s" for c in TIME_CLASSES),
              "peak MiB (formula)", "step MiB (formula)", "saved MiB (formula)"]
    rows = []
    for p in points:
        f = p["formula"]
        rows.append([
            p["shape"]["name"], f"{f['params'] / 1e6:.1f}M", p["tokens"], f"{p['median_s']:.3f}",
            f"{p['tokens_per_s']:.0f}", f"{f['model_flops'] / p['median_s'] / 1e9:.1f}",
            *(f"{p['class_s'][c]:.3f}" for c in TIME_CLASSES),
            *(f"{mib(p[t])} ({mib(f[t])})" for t in MEMORY_TERMS)])
    return harness.markdown_table(header, rows)


def growth_markdown(rows: Sequence[dict[str, Any]]) -> str:
    return harness.markdown_table(
        ["term", "growth vs formula", "exponent k (q ~ f^k)", "share of last step", "verdict"],
        [[r["term"], f"{r['growth']:.2f}", "-" if r["exponent"] is None else f"{r['exponent']:.2f}",
          f"{r['share']:.0%}" if r["term"] in TIME_CLASSES else "", r["verdict"]]
         for r in rows])


def plot(path: os.PathLike[str], sweeps: dict[str, dict[str, Any]]) -> None:
    """One panel per sweep: each term's measured / formula, relative to the sweep's first point
    (a flat line at 1 grows as its formula)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(4.2 * len(sweeps), 3.6), squeeze=False)
    for ax, (name, sweep) in zip(axes[0], sweeps.items(), strict=True):
        points = sweep["points"]
        for term in ("step_time", "gemm", "attention", "elementwise", "peak_bytes"):
            ratios = [q / f if q else math.nan for q, f in (term_values(p, term) for p in points)]
            ax.plot(range(len(points)), [r / ratios[0] for r in ratios], marker="o", label=term)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(points)), [p["shape"]["name"] for p in points], rotation=30,
                      fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("measured / formula (first point = 1)", fontsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = harness.cli.parser(__doc__, harness.cli.steps(3), harness.cli.warmup(1),
                           harness.cli.configs(list(SWEEPS)),
                           harness.cli.switch("--quick", "two tiny points per sweep, one step"))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of the measuring process (default: every core)")
    p.add_argument("--tolerance", type=float, default=0.2,
                   help="growth above 1 + this names a term (default 0.2)")
    p.add_argument("--plot", help="also draw the curves into this PNG file")
    args = p.parse_args()
    table = QUICK if args.quick else SWEEPS
    steps, warmup = (1, 1) if args.quick else (args.steps, args.warmup)
    info = harness.host_info(threads=args.threads)
    print(harness.host_line(info, f"threads {args.threads}, {steps} timed steps per point"))
    names = list(args.configs)
    shapes = [shape for name in names for shape in table[name]]
    timings = harness.spawn(time_points, 1, shapes, steps, warmup, args.threads,
                            timeout=3600)[0]
    memory = harness.spawn(memory_points, 1, shapes, args.threads, timeout=3600,
                           env=harness.EXACT_ALLOCATOR)[0]
    results = iter([t | m for t, m in zip(timings, memory, strict=True)])
    sweeps: dict[str, dict[str, Any]] = {}
    for name in names:
        points = [next(results) for _ in table[name]]
        sweeps[name] = {"points": points, "growth": growth_table(points, args.tolerance)}
        print(f"\n## {name}\n\n{points_table(points)}\n\n{growth_markdown(sweeps[name]['growth'])}")
    faster = [f"{name}: {row['term']} (x{row['growth']:.2f})" for name, sweep in sweeps.items()
              for row in sweep["growth"] if row["verdict"] == "faster than its formula"]
    print("\nterms growing faster than their formula: " + ("; ".join(faster) or "none"))
    if args.plot:
        plot(args.plot, sweeps)
        print(f"plot: {args.plot}")
    harness.write_json(args.json, harness.record(info, args=harness.plain_args(args),
                                                 sweeps=sweeps, faster=faster))


if __name__ == "__main__":
    main()
