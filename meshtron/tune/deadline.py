"""``--max-minutes`` of the searches that run proxies (archsearch, hpsearch): a wall-clock
bound after which no run starts and the search answers from what finished."""

from __future__ import annotations

import time
from collections.abc import Callable


class Deadline:
    """A bound in minutes (None: none) read through an injected clock, so a test passes the
    bound without waiting on a real one."""

    def __init__(self, minutes: float | None, clock: Callable[[], float] | None = None):
        self.minutes, self.clock = minutes, clock or time.monotonic
        self.end = None if minutes is None else self.clock() + 60 * minutes

    def left(self) -> float:
        """Seconds left (infinite without a bound)."""
        return float("inf") if self.end is None else self.end - self.clock()

    def passed(self) -> bool:
        return self.left() <= 0

    def timeout(self, limit_s: float) -> float:
        """A run's time limit: ``limit_s``, or what is left when that is less (at least 1 s)."""
        return max(1.0, min(limit_s, self.left()))
