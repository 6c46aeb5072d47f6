"""Loss curves of one or more runs as a PNG (``meshtron plot``)."""

from __future__ import annotations

from pathlib import Path

from meshtron.errors import MeshtronError
from meshtron.training.metrics import read_metrics


def plot_runs(run_dirs: list[Path], output: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run_dir in run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise MeshtronError(f"{run_dir} is not a run directory (no metrics.jsonl)")
        rows = read_metrics(run_dir)
        line = ax.plot([r["step"] for r in rows], [r["loss"] for r in rows],
                       label=f"{run_dir.name} train")[0]
        evals = [r for r in rows if "val_loss" in r]
        if evals:
            ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o--",
                    color=line.get_color(), label=f"{run_dir.name} valid")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output
