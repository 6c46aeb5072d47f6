"""``meshtron hpsearch``: search learning rate, warm-up, batch and weight decay on proxy runs.

Each trial is a short ``meshtron train`` of the user's config (at each proxy width of
``--widths``) with settings an Optuna sampler proposes (TPE by default, an exhaustive grid with
``--sampler grid``); a pruner (successive halving by default) stops the trials that fall behind
at its rungs. Every width runs the same parameters, so with ``model.mup=true`` one can see the
optimum stay put as the width grows, and without it see it drift. The best settings are
written back into the user's config, for the target model.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from meshtron.config import split_overrides
from meshtron.data.cache import scratch as scratch_dir
from meshtron.errors import MeshtronError
from meshtron.files import check_writable
from meshtron.hpsearch.proxies import WidthProxy, proxies, prune_space
from meshtron.hpsearch.ranking import (
    Row,
    best_by_width,
    best_of,
    curves,
    payload,
    plot_series,
    table,
    write_json,
    write_text,
)
from meshtron.hpsearch.space import Dimension, format_value, grid_size, parse_space
from meshtron.signals import Stopped

PRUNER_NAMES = {"sha": "successive halving", "hyperband": "hyperband", "none": "no pruning"}


def parse_widths(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        widths = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise MeshtronError(f"--widths {text}: give whole numbers, e.g. 64,256") from None
    if not widths or any(w < 1 for w in widths) or len(set(widths)) != len(widths):
        raise MeshtronError(f"--widths {text}: give distinct positive widths, e.g. 64,256")
    return widths


def check_arguments(args: argparse.Namespace) -> None:
    """The command's own numbers and output paths, before any config is read."""
    for flag, value, least in (("--trials", args.trials, 1), ("--nproc", args.nproc, 1),
                               ("--reduction-factor", args.reduction_factor, 2),
                               ("--grid-points", args.grid_points, 2),
                               ("--min-steps", args.min_steps, 1)):
        if value is not None and value < least:
            raise MeshtronError(f"{flag} must be at least {least}, got {value}")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise MeshtronError(f"--max-minutes must be a positive number of minutes, got "
                            f"{args.max_minutes:g}")
    if args.trial_timeout <= 0:
        raise MeshtronError(f"--trial-timeout must be positive, got {args.trial_timeout}")
    for flag, path in (("--json", args.json), ("--output-config", args.output_config),
                       ("--plot", args.plot), ("--study", args.study)):
        if path:
            if Path(path).is_dir():
                raise MeshtronError(f"{flag} {path} is a directory; give a file name")
            check_writable(Path(path).absolute().parent, flag)
    if args.trial_dir:
        check_writable(Path(args.trial_dir), "--trial-dir")


def count_trials(args: argparse.Namespace, dims: Sequence[Dimension], grid: bool) -> int:
    """``--trials``, else 16; a grid runs each point once, and a space of choices alone holds
    no more points than its combinations."""
    if not grid and not all(d.kind == "choice" for d in dims):
        return args.trials or 16
    size = grid_size(dims, args.grid_points)
    if grid:
        return min(args.trials or size, size)
    return args.trials or min(16, size)


def plotted(dims: Sequence[Dimension], want_plot: bool) -> Dimension | None:
    """The x of the plot: the learning rate when searched, else the first numeric field."""
    numeric = [d for d in dims if d.numeric]
    x = next((d for d in numeric if d.name == "train.lr"), numeric[0] if numeric else None)
    if want_plot and x is None:
        raise MeshtronError("--plot needs a numeric field in the search space")
    return x


def run_hpsearch(args: argparse.Namespace, extra: list[str]) -> int:
    """The ``hpsearch`` command, after the CLI has parsed its arguments."""
    check_arguments(args)
    overrides = split_overrides(list(extra))
    widths = parse_widths(args.widths)
    runs = proxies(args.config, overrides, widths, args.nproc)
    dims, notes = prune_space(parse_space(args.space, runs[0].base), runs)
    for line in notes:
        print(line, file=sys.stderr)
    x = plotted(dims, bool(args.plot))
    grid = {d.name: d.grid(args.grid_points) for d in dims} if args.sampler == "grid" else None
    trials = count_trials(args, dims, grid is not None)
    from meshtron.hpsearch.loop import Search

    search = Search(runs, dims, trials, args, grid)
    at = f" at widths {', '.join(map(str, widths))}" if widths else ""
    print(f"hpsearch: {trials} trial{'s' if trials != 1 else ''}{at} over "
          f"{'; '.join(d.describe() for d in dims)} ({args.sampler} sampler, "
          f"{PRUNER_NAMES[args.pruner]})", file=sys.stderr, flush=True)
    with scratch_dir(runs[0].base.data.cache_dir, "hpsearch-") as scratch:
        folder = Path(args.trial_dir or (Path(args.study).with_suffix(".runs") if args.study
                                         else scratch))
        try:
            search.run(folder)
        except (Stopped, KeyboardInterrupt):
            if args.study:
                print(f"hpsearch: interrupted; the same command resumes from {args.study} "
                      "(the unfinished trial runs again)", file=sys.stderr, flush=True)
            raise
    rows = search.rows()
    return report(args, rows, dims, runs, x)


def report(args: argparse.Namespace, rows: list[Row], dims: Sequence[Dimension],
           runs: Sequence[WidthProxy], x: Dimension | None) -> int:
    """The table, the per-width bests, and the files asked for."""
    names = [d.name for d in dims]
    print("\n".join(table(rows, names)))
    best = best_of(rows)
    if args.json:  # also when nothing completed: the errors are in it
        write_json(Path(args.json), payload(rows, [d.describe() for d in dims], args.study))
    if best is None:
        errors = [r.error for r in rows if r.error]
        raise MeshtronError(f"no trial completed ({len(rows)} ran; the first error: "
                            f"{errors[0] if errors else 'none said'})")
    for width, row in best_by_width(rows).items():
        print(f"best at width {width}: {settings_text(row.params)} (loss {row.loss:.4f})")
    print(f"best: {settings_text(best.params)} (loss {best.loss:.4f}"
          + (f", width {best.width})" if best.width else ")"))
    if args.plot and x is not None:
        model = runs[0].base.model
        mup = "model.mup=true" if model.mup else "standard parameterisation"
        plot_series(curves(rows, x.name), Path(args.plot), x.name,
                    f"hpsearch: loss against {x.name} ({mup})", x.log or x.name == "train.lr",
                    pruned=curves(rows, x.name, "pruned"))
    if args.output_config:
        write_output_config(Path(args.output_config), runs[0], best)
    return 0


def settings_text(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={format_value(v)}" for k, v in params.items())


def write_output_config(path: Path, proxy: WidthProxy, best: Row) -> None:
    """The user's config (its own model, not the proxy's width) with the best settings and
    what follows from them (a batch's steps, the schedule's floor)."""
    target = WidthProxy(proxy.config_path, proxy.overrides, proxy.base, None, proxy.nproc)
    cfg = target.config(best.params)
    width = f" at width {best.width}" if best.width else ""
    header = (f"# meshtron hpsearch: best of the search (loss {best.loss:.4f}{width}): "
              f"{settings_text(best.params)}\n"
              f"# run it: meshtron train --config {path.name}\n")
    write_text(path, header + yaml.safe_dump(cfg.to_dict(), sort_keys=False),
               "--output-config")
    print(f"wrote {path}: meshtron train --config {path}", file=sys.stderr)

