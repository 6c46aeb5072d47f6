"""Output: Markdown tables as docs/performance.md has them, profiler summaries, the JSON file."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """``| a | b |`` lines: the header, the ``| --- |`` rule, one line per row (cells as
    given: the caller formats the numbers)."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def top_ops(events: Iterable[Any], iters: int, count: int) -> list[tuple[str, float, int]]:
    """The ``count`` ``torch.profiler`` events with the most self CPU time: (name, seconds and
    calls per iteration), from ``prof.key_averages()`` over ``iters`` iterations."""
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:count]
    return [(e.key, e.self_cpu_time_total / 1e6 / iters, e.count // iters) for e in top]


def print_top_ops(profiles: Mapping[str, Mapping[str, Any]], unit: str) -> None:
    """Each profile's ``top`` list (:func:`top_ops`), ``unit`` naming the iteration."""
    for name, profile in profiles.items():
        print(f"\n{name}: top self-CPU ops (s {unit}, calls {unit})")
        for op, seconds, calls in profile["top"]:
            print(f"  {seconds:8.4f}  {calls:5d}  {op}")


def record(info: dict[str, Any], **parts: Any) -> dict[str, Any]:
    """The JSON report: ``machine`` (:func:`harness.host_info`), the ``command`` line, then
    ``parts`` in order."""
    return {"machine": info, "command": " ".join(sys.argv), **parts}


def plain_args(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as JSON values (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def write_json(path: Path | None, result: Mapping[str, Any]) -> None:
    """Write ``result`` to ``path`` (indented, with a final newline); nothing when None."""
    if path is not None:
        path.write_text(json.dumps(result, indent=2) + "\n")
