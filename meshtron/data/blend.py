"""Blending several datasets with weights, and parsing ``weight:path`` entries.

Sample i of a blend goes to the dataset whose realised share lags its weight the most
(``argmax_d  w_d * (i + 1) - count_d``, ties to the lower index), so every prefix of the blend
holds each dataset within one sample of its weight. The rule is sequential, so it is evaluated
in chunks on demand: the counts at each chunk start are kept (a few integers per chunk) and the
picks of recent chunks are cached, which makes sequential access cheap and any position
reachable.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from meshtron.errors import MeshtronError

CHUNK = 1 << 16
_CACHED_CHUNKS = 4


class WindowDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


class BlendedDataset:
    """Datasets mixed by weight; position i maps to (dataset d, its j-th pick)."""

    def __init__(self, datasets: Sequence[WindowDataset], weights: Sequence[float]) -> None:
        if not datasets or len(datasets) != len(weights):
            raise ValueError("a blend needs one weight per dataset and at least one dataset")
        if not all(math.isfinite(w) and w > 0 for w in weights):
            raise MeshtronError(f"blend weights must be positive numbers, got {list(weights)}")
        for d, dataset in enumerate(datasets):
            if len(dataset) == 0:
                raise MeshtronError(f"blended dataset {d} holds no samples")
        self.datasets = list(datasets)
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        self._chunk_counts: list[np.ndarray] = [np.zeros(len(datasets), dtype=np.int64)]
        self._chunks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        """Nominal size: all the datasets' samples together (used to wrap validation)."""
        return sum(len(d) for d in self.datasets)

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset ids, within-dataset pick numbers) of blend positions; picks are unbounded."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(self.datasets) == 1:
            return np.zeros_like(positions), positions.copy()
        datasets = np.empty_like(positions)
        within = np.empty_like(positions)
        chunk_ids = positions // CHUNK
        for chunk in np.unique(chunk_ids):
            mask = chunk_ids == chunk
            picks, counts = self._chunk(int(chunk))
            offsets = positions[mask] - chunk * CHUNK
            datasets[mask] = picks[offsets]
            within[mask] = counts[offsets]
        return datasets, within

    def __getitem__(self, i: int) -> np.ndarray:
        (d,), (j,) = self.locate(np.array([i]))
        dataset = self.datasets[int(d)]
        return dataset[int(j) % len(dataset)]

    def _chunk(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """Picks and within-dataset pick numbers of one chunk, computing earlier ones as needed."""
        if chunk in self._chunks:
            return self._chunks[chunk]
        while len(self._chunk_counts) <= chunk:
            self._compute(len(self._chunk_counts) - 1)
        return self._compute(chunk)

    def _compute(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        start_counts = self._chunk_counts[chunk]
        picks = np.asarray(
            _greedy(self.weights, start_counts.tolist(), chunk * CHUNK, CHUNK), dtype=np.int64
        )
        within = np.empty(CHUNK, dtype=np.int64)
        for d in range(len(self.datasets)):
            mask = picks == d
            within[mask] = start_counts[d] + np.arange(int(mask.sum()))
        if len(self._chunk_counts) == chunk + 1:
            used = np.bincount(picks, minlength=len(self.datasets))
            self._chunk_counts.append(start_counts + used)
        self._chunks[chunk] = (picks, within)
        while len(self._chunks) > _CACHED_CHUNKS:
            del self._chunks[next(iter(self._chunks))]
        return picks, within


def _greedy(weights: list[float], counts: list[int], start: int, size: int) -> list[int]:
    """The dataset picked at each of positions ``start..start+size`` (a tight scalar loop)."""
    picks = []
    others = range(1, len(weights))
    for position in range(start + 1, start + size + 1):
        best, best_lag = 0, weights[0] * position - counts[0]
        for d in others:
            lag = weights[d] * position - counts[d]
            if lag > best_lag:
                best, best_lag = d, lag
        counts[best] += 1
        picks.append(best)
    return picks


def parse_blend(paths: Sequence[str]) -> list[tuple[float, str]]:
    """``["0.7:a.txt", "b.txt"]`` -> ``[(0.7, "a.txt"), (1.0, "b.txt")]``.

    The text before the first colon is a weight only when it parses as a number, so a path
    that merely contains a colon is kept whole.
    """
    entries = []
    for entry in paths:
        weight, path = 1.0, entry
        head, sep, tail = entry.partition(":")
        if sep:
            with contextlib.suppress(ValueError):
                weight, path = float(head), tail
        if not path:
            raise MeshtronError(f"data.path entry '{entry}' names no path after its weight")
        if not (math.isfinite(weight) and weight > 0):
            raise MeshtronError(
                f"data.path entry '{entry}' has weight {weight}; blend weights must be positive"
            )
        entries.append((weight, path))
    return entries
