"""``meshtron plot``: the loss curves of one or more run directories, drawn to one PNG.

The flags and the checks of the output path need no matplotlib; :mod:`.plot` is imported only
once the command runs (``meshtron --help`` builds this parser)."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshtron.errors import MeshtronError
from meshtron.files import check_writable, png_path


def add_plot_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plot", help="plot loss curves of one or more runs to a PNG")
    p.add_argument("runs", nargs="+", help="run directories (holding metrics.jsonl)")
    p.add_argument("--output", help="PNG path (default: RUN/loss.png, or ./loss.png for several)")
    p.set_defaults(func=run_plot)
    return p


def run_plot(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise MeshtronError(f"unrecognised argument '{extra[0]}'")
    runs = [Path(r) for r in args.runs]
    default = runs[0] / "loss.png" if len(runs) == 1 else Path("loss.png")
    out = png_path(args.output, "loss.png") if args.output else default
    from meshtron.training.plot import check_output_format, plot_runs

    check_output_format(out)
    if all(run.is_dir() for run in runs):  # a run that is not one is plot_runs' to report
        check_writable(out.parent, f"{'--output ' if args.output else ''}{out}: the folder")

    print(plot_runs(runs, out))
    return 0
