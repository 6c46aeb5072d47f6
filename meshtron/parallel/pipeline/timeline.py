"""A pipeline schedule's simulated timeline as a PNG (``meshtron schedule``)."""

from __future__ import annotations

from pathlib import Path

from meshtron.errors import MeshtronError
from meshtron.parallel.pipeline.schedules import Schedule

KIND_COLOURS = (("F", "#4C72B0"), ("B", "#DD8452"), ("W", "#55A868"))


def _shade(hex_colour: str, chunk: int, vpp: int) -> tuple[float, float, float]:
    """The kind's colour, mixed towards white for later chunks so chunks stay distinguishable."""
    rgb = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = 0.55 * chunk / max(vpp - 1, 1)
    r, g, b = (c + (1 - c) * mix for c in rgb)
    return r, g, b


def plot_schedule(schedule: Schedule, output: Path) -> Path:
    """Draw stages as rows and compute actions as boxes labelled with their micro-batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = schedule.timeline()
    makespan = max(row[-1][1] for row in rows if row)
    width = min(max(6.0, 0.28 * makespan + 1.5), 40.0)
    fig, ax = plt.subplots(figsize=(width, 0.6 * schedule.pp + 1.6))
    colours = dict(KIND_COLOURS)
    font = 7 if makespan <= 120 else 5
    for stage, row in enumerate(rows):
        for start, end, action in row:
            ax.barh(stage, end - start, left=start, height=0.8, edgecolor="black", linewidth=0.4,
                    color=_shade(colours[action.kind], action.chunk, schedule.vpp))
            ax.text((start + end) / 2, stage, str(action.microbatch), ha="center",
                    va="center", fontsize=font)
    kinds = [k for k, _ in KIND_COLOURS if k != "W" or schedule.split_backward]
    names = {"F": "forward", "B": "backward (input grad)" if schedule.split_backward
             else "backward", "W": "weight grad"}
    handles = [Patch(color=colours[k], label=names[k]) for k in kinds]
    if schedule.vpp > 1:
        handles += [Patch(color=_shade("#808080", c, schedule.vpp), label=f"chunk {c}")
                    for c in range(schedule.vpp)]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_yticks(range(schedule.pp), [f"stage {s}" for s in range(schedule.pp)])
    ax.set_ylim(schedule.pp - 0.5, -0.5)
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time (F = 1)")
    ax.set_title(f"{schedule.name}: pp={schedule.pp} vpp={schedule.vpp} "
                 f"micro-batches={schedule.microbatches}, bubble "
                 f"{schedule.bubble_fraction():.1%}", fontsize=10)
    fig.tight_layout()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(output, dpi=100)
    except OSError as err:
        reason = err.strerror or err
        raise MeshtronError(f"cannot write the timeline to {output}: {reason}") from err
    finally:
        plt.close(fig)
    return output
