"""The search space of ``meshtron hpsearch``: which config fields vary, over what values.

A dimension is a config field and a range (``train.lr=1e-4:3e-2:log``, ints for int fields)
or a list of choices (``train.global_batch=8,16,32``). Names and values are checked against
the config schema as ``meshtron train`` checks them, so a typo is refused before any trial
runs, with the closest real name. Without ``--space`` the four fields that matter most for a
short run are searched around the config's own values. Optuna is imported only where its
distribution objects are built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from meshtron.config import SECTIONS, Config, config_key
from meshtron.config.checks import suggest
from meshtron.errors import MeshtronError

DEFAULT_FIELDS = ("train.lr", "train.warmup_steps", "train.global_batch", "train.weight_decay")


@dataclass(frozen=True)
class Dimension:
    """One searched field: a range (``low``..``high``, log-scaled or not) or ``choices``."""

    name: str
    kind: str
    """``float`` or ``int`` (a range) or ``choice``."""
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    choices: tuple[Any, ...] = ()

    def describe(self) -> str:
        if self.kind == "choice":
            return f"{self.name}={','.join(format_value(c) for c in self.choices)}"
        scale = ":log" if self.log else ""
        return f"{self.name}={format_value(self.low)}:{format_value(self.high)}{scale}"

    def grid(self, points: int) -> tuple[Any, ...]:
        """The values an exhaustive grid visits: the choices, or ``points`` points spread
        evenly (geometrically under ``log``) over the range, ints rounded and deduplicated."""
        if self.kind == "choice":
            return self.choices
        fractions = [i / (points - 1) for i in range(points)]
        if self.log:
            values = [self.low * (self.high / self.low) ** f for f in fractions]
        else:
            values = [self.low + (self.high - self.low) * f for f in fractions]
        if self.kind == "int":
            return tuple(dict.fromkeys(int(round(v)) for v in values))
        return tuple(float(f"{v:.6g}") for v in values)

    def distribution(self, grid_points: int | None = None) -> Any:
        """The Optuna distribution; on a grid every dimension is categorical over its grid
        (Optuna's GridSampler draws from the grid, the distribution must hold those values)."""
        from optuna.distributions import (
            CategoricalDistribution,
            FloatDistribution,
            IntDistribution,
        )

        if grid_points is not None or self.kind == "choice":
            return CategoricalDistribution(self.grid(grid_points or 2))
        if self.kind == "int":
            return IntDistribution(int(self.low), int(self.high), log=self.log)
        return FloatDistribution(self.low, self.high, log=self.log)

    @property
    def numeric(self) -> bool:
        return self.kind != "choice" or all(
            isinstance(c, (int, float)) and not isinstance(c, bool) for c in self.choices)


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).lower() if isinstance(value, bool) else str(value)


def field_type(name: str) -> Any:
    """The annotated type of config field ``section.field`` (nested: ``model.moe.top_k``), or
    one line naming the closest real field."""
    section, _, rest = name.partition(".")
    if section not in SECTIONS or not rest:
        if section in SECTIONS:
            raise MeshtronError(f"--space {name}: name a field, e.g. {section}.FIELD")
        raise MeshtronError(f"--space: unknown config section '{section}'"
                            f"{suggest(section, SECTIONS)}")
    cls, parts = SECTIONS[section], rest.split(".")
    for i, part in enumerate(parts):
        hints = {config_key(k): v for k, v in typing.get_type_hints(cls).items()}
        if part not in hints:
            known = [f"{section}.{'.'.join(parts[:i] + [k])}" for k in hints]
            raise MeshtronError(f"--space: unknown config key '{name}'{suggest(name, known)}")
        tp = _without_none(hints[part])
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                raise MeshtronError(f"--space {name} is a section; name one of its fields")
            return tp
        if not dataclasses.is_dataclass(tp):
            raise MeshtronError(f"--space: config key '{name}' does not name a field")
        cls = tp
    raise AssertionError("unreachable")


def _without_none(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return inner[0] if len(inner) == 1 else tp
    return tp


def _number(text: str, tp: Any, where: str) -> float | int:
    value = yaml.safe_load(text) if text.strip() else None
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MeshtronError(f"{where}: '{text}' is not a finite number")
    if tp is int:
        if float(value) != int(value):
            raise MeshtronError(f"{where}: {text} is not a whole number (the field is an int)")
        return int(value)
    return float(value)


def _choice(text: str, tp: Any, where: str) -> Any:
    if tp in (int, float):
        return _number(text, tp, where)
    value = yaml.safe_load(text) if text.strip() else ""
    if tp is bool:
        if not isinstance(value, bool):
            raise MeshtronError(f"{where}: '{text}' is not true or false")
        return value
    if tp is str:
        return str(value)
    raise MeshtronError(f"{where}: the field's type ({getattr(tp, '__name__', tp)}) cannot be "
                        "searched; search numbers, booleans or names")


def parse_dimension(text: str) -> Dimension:
    """``section.field=low:high[:log]`` or ``section.field=a,b,c`` (a single value pins it)."""
    name, eq, spec = text.partition("=")
    name = name.strip().lstrip("-")
    where = f"--space {text}"
    if not eq or not spec.strip():
        raise MeshtronError(f"{where}: write section.field=LOW:HIGH[:log] or section.field=A,B,C")
    tp = field_type(name)
    if "," in spec or ":" not in spec:
        values = [v.strip() for v in spec.split(",") if v.strip()]
        choices = tuple(dict.fromkeys(_choice(v, tp, where) for v in values))
        if not choices:
            raise MeshtronError(f"{where}: no values given")
        return Dimension(name, "choice", choices=choices)
    parts = spec.split(":")
    log = parts[-1].strip().lower() == "log"
    if log:
        parts = parts[:-1]
    if len(parts) != 2:
        raise MeshtronError(f"{where}: a range is LOW:HIGH or LOW:HIGH:log")
    if tp not in (int, float):
        raise MeshtronError(f"{where}: {name} is not a number; give its values as A,B,C")
    low, high = (_number(p, tp, where) for p in parts)
    if not low < high:
        raise MeshtronError(f"{where}: the low end {format_value(low)} must be below the high "
                            f"end {format_value(high)}")
    if log and low <= 0:
        raise MeshtronError(f"{where}: a log range needs a positive low end, got "
                            f"{format_value(low)}")
    return Dimension(name, "int" if tp is int else "float", low, high, log)


def default_space(cfg: Config) -> list[Dimension]:
    """Learning rate (a decade either side, log), warm-up (0 to a quarter of the steps),
    global batch (half, same, double) and weight decay (0 to twice the config's, at least
    0.2), around the config's own values."""
    t, g = cfg.train, cfg.train.global_batch
    batches = tuple(b for b in (g // 2 if g % 2 == 0 else 0, g, 2 * g) if b)
    return [Dimension("train.lr", "float", t.lr / 10, t.lr * 10, log=True),
            Dimension("train.warmup_steps", "int", 0, max(1, t.steps // 4)),
            Dimension("train.global_batch", "choice", choices=batches),
            Dimension("train.weight_decay", "float", 0.0, max(0.2, 2 * t.weight_decay))]


def parse_space(texts: Sequence[str] | None, cfg: Config) -> list[Dimension]:
    """The dimensions of ``--space`` arguments (each field once), or the default space."""
    if not texts:
        return default_space(cfg)
    dims: dict[str, Dimension] = {}
    for text in texts:
        dim = parse_dimension(text)
        if dim.name in dims:
            raise MeshtronError(f"--space {dim.name} is given twice")
        dims[dim.name] = dim
    return list(dims.values())


def grid_size(dims: Sequence[Dimension], points: int) -> int:
    return math.prod(len(d.grid(points)) for d in dims)


def with_choices(dim: Dimension, choices: Sequence[Any]) -> Dimension:
    return dataclasses.replace(dim, choices=tuple(choices))
