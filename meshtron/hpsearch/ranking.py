"""What hpsearch shows and writes: the ranked table, the JSON, the loss-against-parameter plot.

Rows are read back from the studies (not from the running search), so a resumed search reports
every trial its study file holds, the earlier ones included.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from meshtron.errors import MeshtronError
from meshtron.files import os_reason
from meshtron.hpsearch.space import format_value

RANK = {"complete": 0, "pruned": 1, "failed": 2, "running": 3, "waiting": 3}


@dataclass(frozen=True)
class Row:
    """One trial as reported."""

    number: int
    width: int | None
    params: dict[str, Any]
    loss: float | None
    status: str
    steps: int | None = None
    planned_steps: int | None = None
    error: str | None = None
    seconds: float | None = None

    def json(self) -> dict[str, Any]:
        out = {"params": self.params, "loss": self.loss, "status": self.status,
               **{k: v for k, v in asdict(self).items() if k not in ("params", "loss", "status")}}
        return out if self.width is not None else {k: v for k, v in out.items() if k != "width"}


def ranked(rows: Sequence[Row]) -> list[Row]:
    """Width by width: completed trials by loss, then pruned ones by their last loss, then
    failed ones."""
    return sorted(rows, key=lambda r: (r.width or 0, RANK[r.status],
                                       r.loss if r.loss is not None else math.inf, r.number))


def best_of(rows: Sequence[Row]) -> Row | None:
    """The completed trial of lowest loss (None when no trial completed)."""
    done = [r for r in rows if r.status == "complete" and r.loss is not None]
    return min(done, key=lambda r: (r.loss, r.number)) if done else None


def best_by_width(rows: Sequence[Row]) -> dict[int, Row]:
    widths = sorted({r.width for r in rows if r.width is not None})
    out = {w: best_of([r for r in rows if r.width == w]) for w in widths}
    return {w: r for w, r in out.items() if r is not None}


def table(rows: Sequence[Row], names: Sequence[str]) -> list[str]:
    """The ranked table: parameters, loss, status, steps run of planned, and why a trial
    failed."""
    widths = any(r.width is not None for r in rows)
    heads = (["width"] if widths else []) + ["trial", *names, "loss", "status", "steps"]
    cells = []
    for r in ranked(rows):
        steps = f"{r.steps if r.steps is not None else '-'}/{r.planned_steps or '-'}"
        cells.append(([str(r.width)] if widths else []) + [
            str(r.number), *(format_value(r.params.get(n, "-")) for n in names),
            f"{r.loss:.4f}" if r.loss is not None else "-", r.status, steps,
            r.error or ""])
    sizes = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(s) for h, s in zip(heads, sizes)).rstrip()]
    for c in cells:
        lines.append(("  ".join(v.rjust(s) for v, s in zip(c, sizes)) + "  " + c[-1]).rstrip())
    return lines


def payload(rows: Sequence[Row], space: Sequence[str], study: str | None) -> dict[str, Any]:
    """The ``--json`` document: ``best`` (the chosen settings), every trial, per-width bests."""
    best = best_of(rows)
    out: dict[str, Any] = {"best": dict(best.params) if best else {},
                           "best_loss": best.loss if best else None}
    by_width = best_by_width(rows)
    if by_width:
        out["best_width"] = best.width if best else None
        out["best_by_width"] = {str(w): {"params": r.params, "loss": r.loss}
                                for w, r in by_width.items()}
    out.update(trials=[r.json() for r in sorted(rows, key=lambda r: (r.width or 0, r.number))],
               space=list(space), study=study)
    return out


def write_text(path: Path, text: str, what: str) -> None:
    try:
        path.write_text(text)
    except OSError as err:
        raise MeshtronError(f"cannot write {what} {path} ({os_reason(err)})") from None


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    write_text(path, json.dumps(data, indent=2) + "\n", "--json")


def curves(rows: Sequence[Row], x: str, status: str = "complete"
           ) -> dict[str, list[tuple[float, float]]]:
    """The (``x``, loss) points of the trials with ``status`` (a pruned trial's loss is its
    last, at the step it was stopped), one series per width."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.status == status and r.loss is not None and x in r.params:
            label = f"width {r.width}" if r.width is not None else "trials"
            out.setdefault(label, []).append((float(r.params[x]), r.loss))
    return out


def plot_series(series: Mapping[str, Sequence[tuple[float, float]]], path: Path, xlabel: str,
                title: str, log_x: bool,
                pruned: Mapping[str, Sequence[tuple[float, float]]] | None = None) -> None:
    """Loss against one parameter: every point as a marker, a line through the lowest loss at
    each value, the best point of each series ringed; ``pruned`` trials (their last loss,
    usually above where they would have ended) as crosses of their series' colour."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))  # not pyplot: no global figure registry to close it from
    ax = fig.add_subplot()
    colors: dict[str, Any] = {}
    for label, points in series.items():
        if not points:
            continue
        lowest: dict[float, float] = {}
        for x, y in points:
            lowest[x] = min(y, lowest.get(x, math.inf))
        xs = sorted(lowest)
        (line,) = ax.plot(xs, [lowest[x] for x in xs], marker="o", label=label)
        ax.scatter([p[0] for p in points], [p[1] for p in points], color=line.get_color(),
                   s=12)
        bx = min(xs, key=lambda x: lowest[x])
        ax.scatter([bx], [lowest[bx]], s=160, facecolors="none",
                   edgecolors=line.get_color())
        colors[label] = line.get_color()
    for label, points in (pruned or {}).items():
        if points:
            ax.scatter([p[0] for p in points], [p[1] for p in points], marker="x", s=30,
                       color=colors.get(label), label=f"{label}, pruned (last loss)")
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("final validation loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise MeshtronError(f"cannot write --plot {path} ({os_reason(err)})") from None

