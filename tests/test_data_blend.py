"""Blending by weight, blend-entry parsing, and the global sampler's (seed, k) contract."""

from __future__ import annotations

import numpy as np
import pytest

from meshtron.data import BlendedDataset, GlobalSampler, parse_blend
from meshtron.data import blend as blend_module
from meshtron.errors import MeshtronError


class Constant:
    """A dataset whose sample j is [tag, j]: shows where a blended sample came from."""

    def __init__(self, tag: int, size: int) -> None:
        self.tag, self.size = tag, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, j: int) -> np.ndarray:
        return np.array([self.tag, j])


def reference_blend(weights: list[float], n: int) -> list[int]:
    """The greedy rule written plainly: pick the dataset whose share lags its weight most."""
    total = sum(weights)
    counts = [0] * len(weights)
    picks = []
    for i in range(n):
        lags = [w / total * (i + 1) - c for w, c in zip(weights, counts, strict=True)]
        d = max(range(len(weights)), key=lambda k: (lags[k], -k))
        counts[d] += 1
        picks.append(d)
    return picks


def test_blend_matches_the_greedy_rule_across_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blend_module, "CHUNK", 64)
    rng = np.random.default_rng(0)
    for _ in range(5):
        weights = (rng.random(rng.integers(2, 5)) + 0.05).tolist()
        blend = BlendedDataset([Constant(d, 10) for d in range(len(weights))], weights)
        positions = np.arange(1000)
        datasets, within = blend.locate(positions[::-1].copy())  # any order, any chunk first
        expected = np.array(reference_blend(weights, 1000))
        np.testing.assert_array_equal(datasets[::-1], expected)
        for d in range(len(weights)):  # within-dataset pick numbers count 0, 1, 2, ...
            assert within[::-1][expected == d].tolist() == list(range(int((expected == d).sum())))


def test_blend_proportions_and_determinism() -> None:
    weights = [0.5, 0.3, 0.2]
    blend = BlendedDataset([Constant(d, 7) for d in range(3)], weights)
    n = 200_000  # several chunks
    datasets, _ = blend.locate(np.arange(n))
    counts = np.bincount(datasets, minlength=3)
    assert np.all(np.abs(counts - np.array(weights) * n) <= 1)
    prefix_counts = np.cumsum(np.eye(3, dtype=np.int64)[datasets[:5000]], axis=0)
    ideal = np.outer(np.arange(1, 5001), weights)
    assert np.abs(prefix_counts - ideal).max() < 1.0  # every prefix within one sample
    again = BlendedDataset([Constant(d, 7) for d in range(3)], [5, 3, 2])  # normalised
    np.testing.assert_array_equal(again.locate(np.arange(n - 100, n))[0], datasets[-100:])
    sample = blend[12345]
    d, j = blend.locate(np.array([12345]))
    assert sample.tolist() == [d[0], j[0] % 7]  # picks wrap around a dataset
    assert len(blend) == 21


def test_single_dataset_blend_is_the_identity() -> None:
    blend = BlendedDataset([Constant(0, 5)], [3.0])
    datasets, within = blend.locate(np.arange(12))
    assert datasets.tolist() == [0] * 12 and within.tolist() == list(range(12))


@pytest.mark.parametrize("weights", [[1.0, 0.0], [1.0, -2.0], [float("nan"), 1.0]])
def test_blend_rejects_bad_weights(weights: list[float]) -> None:
    with pytest.raises(MeshtronError, match="blend weights must be positive"):
        BlendedDataset([Constant(0, 3), Constant(1, 3)], weights)


def test_parse_blend() -> None:
    assert parse_blend(["0.7:a.txt", "b.txt", "3:dir/c"]) == [
        (0.7, "a.txt"), (1.0, "b.txt"), (3.0, "dir/c")
    ]
    assert parse_blend(["./x:y", "data:v2.jsonl"]) == [(1.0, "./x:y"), (1.0, "data:v2.jsonl")]
    assert parse_blend(["0.5:weird:name.txt"]) == [(0.5, "weird:name.txt")]
    with pytest.raises(MeshtronError, match="'0:a.txt' has weight 0.0"):
        parse_blend(["0:a.txt"])
    with pytest.raises(MeshtronError, match="names no path"):
        parse_blend(["0.5:"])


def test_sampler_depends_only_on_seed_and_k() -> None:
    forward = GlobalSampler(50, 8, seed=3)
    first = [forward.batch_indices(k) for k in range(20)]
    backward = GlobalSampler(50, 8, seed=3)
    for k in reversed(range(20)):
        np.testing.assert_array_equal(backward.batch_indices(k), first[k])
    resumed = GlobalSampler(50, 8, seed=3)
    np.testing.assert_array_equal(resumed.batch_indices(13), first[13])
    assert first[0].dtype == np.int64 and first[0].shape == (8,)


def test_sampler_covers_each_epoch_exactly_once() -> None:
    sampler = GlobalSampler(40, 8, seed=1)
    epoch0 = np.concatenate([sampler.batch_indices(k) for k in range(5)])
    epoch1 = np.concatenate([sampler.batch_indices(k) for k in range(5, 10)])
    assert sorted(epoch0.tolist()) == list(range(40)) == sorted(epoch1.tolist())
    assert epoch0.tolist() != epoch1.tolist()  # reshuffled per epoch
    straddling = GlobalSampler(10, 4, seed=1)  # batches cross epoch boundaries
    stream = np.concatenate([straddling.batch_indices(k) for k in range(5)])
    assert sorted(stream[:10].tolist()) == list(range(10)) == sorted(stream[10:20].tolist())


def test_sampler_seeds_and_streams_differ() -> None:
    base = GlobalSampler(1000, 16, seed=0).batch_indices(0)
    assert not np.array_equal(base, GlobalSampler(1000, 16, seed=1).batch_indices(0))
    assert not np.array_equal(base, GlobalSampler(1000, 16, seed=0, stream=1).batch_indices(0))
    assert GlobalSampler(10, 2, seed=-5).batch_indices(0).shape == (2,)  # negative seeds work
