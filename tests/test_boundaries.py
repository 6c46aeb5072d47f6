"""Cases the mutation pass (benchmarks/mutation.py) found that no test looked at: the token ids
at a vocabulary shard's edges, boxes that touch without overlapping, the blend's ties, which
tokens top-k keeps, the residual projections' init scale, selective recompute's saved bytes
with fewer kv heads than heads, and the ring collectives' closed form. Each is cheap, in one
process, and written from the definition rather than from the code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from meshtron.checkpoint.boxes import intersect
from meshtron.config import load_config
from meshtron.costmodel import comms
from meshtron.costmodel.activations import activation_bytes_per_layer
from meshtron.costmodel.profiles import load_profile
from meshtron.data.blend import BlendedDataset
from meshtron.models.generation import filter_logits
from meshtron.models.init import initial_value
from meshtron.models.transformer import ModelOptions, Transformer
from meshtron.parallel.mesh.groups import CommStats, Group
from meshtron.parallel.tensor.layers import TPRegion, VocabParallelEmbedding
from meshtron.training.live_memory import LiveTensorBytes


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


def test_top_k_keeps_exactly_the_k_best_tokens_untouched():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0, 1.0], [4.0, 0.0, 1.0, 3.0, 2.0]])
    kept = filter_logits(logits, 3, 1.0)
    assert torch.isfinite(kept).tolist() == [[False, True, False, True, True],
                                             [True, False, False, True, True]]
    assert torch.equal(kept[torch.isfinite(kept)], logits[torch.isfinite(kept)])
    assert torch.equal(filter_logits(logits, 5, 1.0), logits)  # k = vocabulary: nothing goes


def test_residual_projections_start_at_std_over_sqrt_2_layers():
    """GPT-2's scaled init: the projections that write into the residual stream (attention
    output, MLP down) at std / sqrt(2 L), every other matrix at std (sample std of 65k draws,
    within 2%)."""
    std, layers, shape = 0.02, 8, (256, 256)
    for name, expected in (("layers.3.attn.proj.weight", std / (2 * layers) ** 0.5),
                           ("layers.3.mlp.down.weight", std / (2 * layers) ** 0.5),
                           ("layers.3.attn.qkv.weight", std)):
        drawn = initial_value(name, shape, seed=0, std=std, num_layers=layers)
        assert abs(float(drawn.std()) / expected - 1) < 0.02, name


def test_selective_recompute_with_fewer_kv_heads_than_heads_matches_live_storages():
    """Selective recompute drops one log-sum-exp per query head (not per kv head): one block's
    live bytes after forward (2 layers minus 1) under grouped-query attention."""
    tokens = torch.randint(0, 500, (2, 17), generator=torch.Generator().manual_seed(0))
    alive = []
    for layers in (1, 2):
        cfg = load_config(overrides=["--model.vocab_size=512", "--model.hidden_size=64",
                                     "--model.num_heads=4", "--model.num_kv_heads=1",
                                     "--model.ffn_hidden_size=96",
                                     f"--model.num_layers={layers}"]).model
        model = Transformer(cfg, options=ModelOptions(recompute="selective"))
        with LiveTensorBytes() as live:
            loss = model.loss_sum(model(tokens[:, :-1]), tokens[:, 1:])
            alive.append(live.bytes())
        del loss
    assert alive[1] - alive[0] == activation_bytes_per_layer(cfg, 2, 16, recompute="selective")


@pytest.mark.parametrize("kind, steps", [("all_reduce", 2), ("all_gather", 1),
                                         ("reduce_scatter", 1)])
def test_ring_collectives_follow_the_alpha_beta_closed_form(kind, steps):
    """A ring over n ranks: steps x (n - 1) messages of latency alpha, and each rank moves
    steps x (n - 1) / n of the buffer at the link's bandwidth."""
    profile, n, nbytes = load_profile("h100-sxm"), 8, 2.0**30
    link = profile.inter_node
    seconds = comms.collective_seconds(profile, kind, comms.PricedGroup(n, True), nbytes)
    expected = steps * (n - 1) * link.latency + steps * (n - 1) / n * nbytes / link.bandwidth
    assert seconds == pytest.approx(expected, rel=1e-12)
