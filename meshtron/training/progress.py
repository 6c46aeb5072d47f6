"""A one-line live progress bar on stderr (only when stderr is a terminal)."""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ProgressBar:
    def __init__(self, total: int, start: int, enabled: bool):
        self.total, self.start = total, start
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self._shown = False

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - step) if done else 0.0
        width = 24
        filled = int(width * step / self.total)
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(
            f"\r[{bar}] {step}/{self.total} loss {loss:.4f} {tokens_per_s:,.0f} tok/s "
            f"ETA {_clock(eta)} "
        )
        sys.stderr.flush()
        self._shown = True

    def clear(self) -> None:
        """Erase the bar so that a log line can be printed cleanly."""
        if self._shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self._shown = False
