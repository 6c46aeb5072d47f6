"""Loss curves of one or more runs as a PNG (``meshtron plot``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from meshtron.errors import MeshtronError
from meshtron.training.metrics import read_metrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MARKED_POINTS = 50
"""Series with at most this many points get a marker at every point: a line through one point
draws nothing, and a few points read better as points."""


def draw_runs(ax: Axes, run_dirs: list[Path]) -> None:
    """Each run's training loss (and validation loss, where it has any) on ``ax``."""
    for run_dir in run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise MeshtronError(f"{run_dir} is not a run directory (no metrics.jsonl)")
        rows = read_metrics(run_dir)
        train = [r for r in rows if "loss" in r]
        marker = "o" if len(train) <= MARKED_POINTS else None
        line = ax.plot([r["step"] for r in train], [r["loss"] for r in train], marker=marker,
                       markersize=4, label=f"{run_dir.name} train")[0]
        evals = [r for r in rows if "val_loss" in r]
        if evals:
            ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o--",
                    color=line.get_color(), label=f"{run_dir.name} valid")
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
