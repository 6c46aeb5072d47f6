"""The global sampler: which samples make up global batch k, as a function of (seed, k) only.

This is the data half of the parity contract: the sample at global position
``i = k * global_batch + j`` is entry ``i mod n`` of a permutation of ``range(n)`` seeded by
``(seed, stream, epoch = i // n)``. Nothing depends on rank, layout or how many batches were
drawn before, so any layout sees the same global batch and a resumed run continues exactly.
Each rank slices its share of the batch afterwards.
"""

from __future__ import annotations

import numpy as np


class GlobalSampler:
    """Per-epoch shuffled sample indices for global batches of ``global_batch`` samples."""

    def __init__(self, num_samples: int, global_batch: int, seed: int, stream: int = 0) -> None:
        if num_samples < 1 or global_batch < 1:
            raise ValueError("num_samples and global_batch must be positive")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.stream = stream
        """Separates samplers sharing a seed, e.g. one per blended dataset."""
        self._permutations: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of all samples in ``epoch`` (the two most recently built are kept)."""
        if epoch not in self._permutations:
            key = [self.seed % 2**64, self.stream, epoch]
            rng = np.random.Generator(np.random.PCG64(key))
            self._permutations[epoch] = rng.permutation(self.num_samples)
            while len(self._permutations) > 2:
                del self._permutations[next(iter(self._permutations))]
        return self._permutations[epoch]

    def indices(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices at the given global positions (any non-negative int64 array)."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs = positions // self.num_samples
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.permutation(int(epoch))[positions[mask] - epoch * self.num_samples]
        return out

    def batch_indices(self, k: int) -> np.ndarray:
        """The ``global_batch`` sample indices of global batch ``k``."""
        start = k * self.global_batch
        return self.indices(np.arange(start, start + self.global_batch, dtype=np.int64))
