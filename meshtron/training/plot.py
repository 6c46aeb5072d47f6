"""Loss curves of one or more runs as a PNG (``meshtron plot``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshtron.errors import MeshtronError
from meshtron.training.metrics import read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MARKED_POINTS = 50
"""Series with at most this many points get a marker at every point: a line through one point
draws nothing, and a few points read better as points."""

MAX_STEP = 2**63
"""Steps at or past this are not a training step (and overflow the plotting arrays)."""
MAX_VALUE = 1e300
"""Losses past this magnitude are left out like non-finite ones: the axis arithmetic
overflows on a range such as -1e308..1e308 (no loss of a real run comes near)."""
PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "webp", "eps", "ps", "tif", "tiff")
"""The file types ``--output``'s extension may name (matplotlib writes each)."""


def check_output_format(path: Path, flag: str = "--output") -> None:
    """The extension of ``path`` names an image format, said before the runs are read."""
    kind = path.suffix.lstrip(".").lower()
    if kind not in PLOT_FORMATS:
        raise MeshtronError(f"{flag} {path}: .{kind} is not an image format; use one of "
                            f"{', '.join('.' + f for f in PLOT_FORMATS)}")


def _number(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a real number (bools included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and abs(value) >= MAX_STEP:
        return None
    return float(value) if math.isfinite(value) and abs(value) <= MAX_VALUE else None


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """The (steps, values) of ``key`` over the rows that have an integer step and a finite
    number under ``key``; other rows (events, torn or hand-edited ones) are left out."""
    steps, values = [], []
    for row in rows:
        step, value = row.get("step"), _number(row.get(key))
        if type(step) is int and 0 <= step < MAX_STEP and value is not None:
            steps.append(step)
            values.append(value)
    return steps, values


def draw_runs(ax: Axes, run_dirs: list[Path]) -> None:
    """Each run's training loss (and validation loss, where it has any) on ``ax``."""
    for run_dir in run_dirs:
        path = run_dir / "metrics.jsonl"
        if not path.is_file():
            raise MeshtronError(f"{run_dir} is not a run directory (no metrics.jsonl)")
        rows = read_metrics(run_dir)
        train, evals = series(rows, "loss"), series(rows, "val_loss")
        if not train[0] and not evals[0]:
            raise MeshtronError(f"{path} holds no rows with an integer step and a finite loss, "
                                "so there is nothing to plot")
        color = None
        if train[0]:
            marker = "o" if len(train[0]) <= MARKED_POINTS else None
            color = ax.plot(*train, marker=marker, markersize=4,
                            label=f"{run_dir.name} train")[0].get_color()
        if evals[0]:
            ax.plot(*evals, "o--", color=color, label=f"{run_dir.name} valid")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()


def plot_runs(run_dirs: list[Path], output: Path) -> Path:
    """Draw the runs' loss curves into the PNG ``output``; returns ``output``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))  # not pyplot: no global figure registry, no backend choice
    draw_runs(fig.add_subplot(), run_dirs)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    return output
