"""Timing: one timed call, interleaved rounds of competitors, and the figures drawn from them.

Competitors are interleaved, not run one after the other: in every round each takes one step,
and the order rotates every round, so load from other jobs that drifts during a run hits all of
them alike. The reports use two ratios of competitor A to B: the *ratio of medians*
``median(A) / median(B)``, and the *pair ratio* ``median(a_i / b_i)`` over rounds ``i``, which
compares steps taken close together in time and so is less sensitive to slow drifts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def rotated(items: Sequence[T], k: int) -> list[T]:
    """``items`` starting at position ``k`` (modulo their number): the order of round ``k``."""
    k %= len(items)
    return [*items[k:], *items[:k]]


@dataclass(frozen=True)
class Timed(Generic[R]):
    """One timed call: wall seconds, seconds of the CPU clock (None without one), its value."""

    wall: float
    cpu: float | None
    value: R


def timed(call: Callable[[], R], *, barrier: Callable[[], object] | None = None,
          settle: Callable[[], object] | None = None,
          cpu: Callable[[], float] | None = None) -> Timed[R]:
    """``call()`` timed with ``perf_counter`` and, if given, the ``cpu`` clock
    (``time.thread_time``, ``time.process_time``). ``barrier`` runs first, untimed, so that all
    ranks start together and a lagging peer is not charged to this call; ``settle`` runs after
    it, timed (a barrier: until every rank is done; a device synchronize)."""
    if barrier is not None:
        barrier()
    start = time.perf_counter()
    start_cpu = cpu() if cpu is not None else 0.0
    value = call()
    if settle is not None:
        settle()
    wall = time.perf_counter() - start
    used = cpu() - start_cpu if cpu is not None else None
    return Timed(wall, used, value)


@dataclass
class Interleaved(Generic[R]):
    """Per competitor: wall and CPU seconds of the timed rounds, and the first call's value
    (warm-up included)."""

    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    first: dict[str, R] = field(default_factory=dict)


def interleave(calls: Mapping[str, Callable[[], R]], rounds: int, *, warmup: int = 0,
               rotate: bool = True, barrier: Callable[[], object] | None = None,
               cpu: Callable[[], float] | None = None) -> Interleaved[R]:
    """``warmup`` untimed then ``rounds`` timed rounds, in each of which every call runs once
    (:func:`timed`), in an order that rotates every round, or in the mapping's order every
    round when not ``rotate``."""
    names = list(calls)
    out: Interleaved[R] = Interleaved({n: [] for n in names}, {n: [] for n in names})
    for r in range(warmup + rounds):
        for name in rotated(names, r) if rotate else names:
            result = timed(calls[name], barrier=barrier, cpu=cpu)
            out.first.setdefault(name, result.value)
            if r >= warmup:
                out.wall[name].append(result.wall)
                if result.cpu is not None:
                    out.cpu[name].append(result.cpu)
    return out


def ratio_of_medians(a: Iterable[float], b: Iterable[float]) -> float:
    """``median(a) / median(b)``."""
    return statistics.median(a) / statistics.median(b)


def pair_ratio(a: Iterable[float], b: Iterable[float]) -> float:
    """The median over ``i`` of ``a[i] / b[i]`` (the same round, step or run)."""
    return statistics.median([x / y for x, y in zip(a, b, strict=True)])


def across_ranks(per_rank: Iterable[Sequence[float]],
                 combine: Callable[[Sequence[float]], float] = max) -> list[float]:
    """Per step, ``combine`` of the ranks' figures: ``max``, the slowest rank's time (the step
    is done when every rank is), or ``statistics.mean``."""
    return [combine(step) for step in zip(*per_rank)]


def check_close(values: Mapping[str, float], what: str, *, rel: float = 1e-4,
                reference: str | None = None) -> None:
    """Raise AssertionError unless every value is within ``rel`` (relative) of
    ``values[reference]`` (default: the first value)."""
    ref = values[reference] if reference is not None else next(iter(values.values()))
    if any(abs(v - ref) > rel * abs(ref) for v in values.values()):
        raise AssertionError(f"{what} differ by more than {rel:g} relative: {dict(values)}")
