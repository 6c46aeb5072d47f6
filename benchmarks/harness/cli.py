"""The flags the benchmarks share: ``parser(__doc__, steps(10), warmup(2), ...)`` gives an
``ArgumentParser`` with ``--json OUT`` and the flags asked for, with the script's defaults; the
script adds what only it has."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Flag:
    """One ``add_argument`` call: the flag and its keyword arguments."""

    name: str
    options: Mapping[str, Any]


def steps(default: int, text: str = "timed steps") -> Flag:
    """``--steps N``."""
    return Flag("--steps", {"type": int, "default": default, "help": text})


def warmup(default: int, text: str = "untimed steps before the timed ones") -> Flag:
    """``--warmup N``."""
    return Flag("--warmup", {"type": int, "default": default, "help": text})


def rounds(default: int, text: str) -> Flag:
    """``--rounds R``."""
    return Flag("--rounds", {"type": int, "default": default, "help": text})


def timeout(default: float, text: str) -> Flag:
    """``--timeout SECONDS``."""
    return Flag("--timeout", {"type": float, "default": default, "help": text})


def configs(names: Sequence[str]) -> Flag:
    """``--configs NAME ...``: the configurations to run (default: all)."""
    return Flag("--configs", {"nargs": "+", "choices": list(names), "default": list(names),
                              "help": "configurations to run (default: all)"})


def switch(name: str, text: str) -> Flag:
    """An on/off flag: ``--profile``, or a smoke mode (``--quick``, ``--smoke``)."""
    return Flag(name, {"action": "store_true", "help": text})


def parser(doc: str, *flags: Flag, json_default: Path | None = None) -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc``, with ``--json OUT`` (every figure to
    that file; written only when given, unless ``json_default``) and ``flags``."""
    out = argparse.ArgumentParser(description=doc.splitlines()[0])
    out.add_argument("--json", type=Path, default=json_default,
                     help="where to write every figure" if json_default else
                     "also write every figure to this file")
    for flag in flags:
        out.add_argument(flag.name, **flag.options)
    return out
