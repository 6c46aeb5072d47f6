"""Boundary cases the mutation pass (benchmarks/mutation.py) found that no test looked at: the
token ids at a vocabulary shard's edges, boxes that touch without overlapping, and the blend's
ties. Each is cheap, in one process, and written from the definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshtron.checkpoint.boxes import intersect
from meshtron.data.blend import BlendedDataset
from meshtron.parallel.mesh.groups import CommStats, Group
from meshtron.parallel.tensor.layers import TPRegion, VocabParallelEmbedding


@pytest.mark.parametrize("tp", [2, 4])
def test_every_token_id_embeds_to_its_own_row_across_the_vocabulary_shards(tp):
    """Every id of the padded vocabulary, the first and last of each shard included: the
    shards' partial outputs (what the all-reduce sums) add up to the whole table's row, and
    each shard answers only for its own rows."""
    vocab, dim = 16, 3
    table = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(0))
    tokens = torch.arange(vocab).view(2, -1)
    partials = []
    for rank in range(tp):
        region = TPRegion(Group("tp", list(range(tp)), rank, None, CommStats()))
        embedding = VocabParallelEmbedding(vocab, dim, region)
        with torch.no_grad():
            embedding.weight.copy_(table.chunk(tp)[rank])
        partials.append(embedding(tokens))
        rows = vocab // tp
        owned = (tokens >= rank * rows) & (tokens < (rank + 1) * rows)
        assert torch.equal(partials[-1].abs().sum(-1) > 0, owned)
    assert torch.equal(sum(partials), F.embedding(tokens, table))


def test_boxes_that_touch_do_not_overlap():
    """A checkpoint box read only where it overlaps: an edge in common is no overlap (an empty
    read of every neighbouring shard otherwise)."""
    assert intersect(((0,), (4,)), ((4,), (4,))) is None
    assert intersect(((0, 0), (2, 4)), ((2, 0), (2, 4))) is None
    assert intersect(((0, 0), (4, 4)), ((0, 4), (4, 4))) is None
    assert intersect(((0,), (4,)), ((2,), (4,))) == ((2,), (2,))
    assert intersect(((1, 2), (3, 3)), ((2, 0), (4, 4))) == ((2, 2), (2, 2))


def test_blend_ties_go_to_the_lower_index():
    """The blend's rule as documented: sample i goes to argmax_d w_d (i + 1) - count_d, ties
    to the lower index, worked out by hand for equal and for 1:1:2 weights."""
    data = [[np.zeros(1)] for _ in range(3)]
    assert BlendedDataset(data[:2], [1, 1]).locate(np.arange(6))[0].tolist() == [0, 1] * 3
    picks = BlendedDataset(data, [1, 1, 2]).locate(np.arange(6))[0].tolist()
    assert picks == [2, 0, 1, 2, 2, 0]
