"""The activation-memory formula against what autograd really keeps, with and without TP/SP,
and against every storage alive after the forward pass under each recompute mode."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import load_config
from meshtron.costmodel.activations import activation_bytes_per_layer
from meshtron.models.init import initialize
from meshtron.models.transformer import ModelOptions, Transformer
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.training.live_memory import LiveTensorBytes
from meshtron.training.memory import measure_saved_bytes
from tests.distributed import run_distributed

BATCH, SEQ = 2, 16


def per_layer_measured(overrides: list[str], mesh: ParallelMesh) -> int:
    """Saved bytes of a 2-layer model minus those of a 1-layer model: one block's share."""
    tokens = torch.randint(0, 500, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    saved = []
    for layers in (1, 2):
        cfg = load_config(overrides=["--model.vocab_size=512", "--model.hidden_size=64",
                                     "--model.num_heads=4", "--model.ffn_hidden_size=96",
                                     f"--model.num_layers={layers}", *overrides]).model
        model = Transformer(cfg, mesh)
        initialize(model, seed=0, std=0.02, num_layers=layers)
        saved.append(measure_saved_bytes(model, tokens))
    return saved[1] - saved[0], cfg


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_formula_matches_one_process(kv_heads):
    measured, cfg = per_layer_measured([f"--model.num_kv_heads={kv_heads}"],
                                       ParallelMesh.single())
    assert measured == activation_bytes_per_layer(cfg, BATCH, SEQ)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_every_storage_alive_after_forward_matches_the_formula(recompute):
    """Not what autograd's hooks see (they miss what checkpointed regions keep) but every
    storage created in the forward pass and still alive before backward: one block's share
    (2 layers minus 1) is the formula's, for each recompute mode."""
    tokens = torch.randint(0, 500, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    alive = []
    for layers in (1, 2):
        cfg = load_config(overrides=["--model.vocab_size=512", "--model.hidden_size=64",
                                     "--model.num_heads=4", "--model.ffn_hidden_size=96",
                                     f"--model.num_layers={layers}"]).model
        model = Transformer(cfg, options=ModelOptions(recompute=recompute))
        initialize(model, seed=0, std=0.02, num_layers=layers)
        with LiveTensorBytes() as live:
            loss = model.loss_sum(model(tokens[:, :-1]), tokens[:, 1:])
            alive.append(live.bytes())
            loss.backward()
    assert alive[1] - alive[0] == activation_bytes_per_layer(cfg, BATCH, SEQ, recompute=recompute)
    if recompute == "full":
        assert alive[1] - alive[0] == 4 * BATCH * SEQ * cfg.hidden_size  # the block's input


def tp_measurements(rank: int, world_size: int) -> list[tuple[int, int]]:
    out = []
    for sp in (False, True):
        mesh = ParallelMesh(MeshLayout(world_size, tp=world_size, sp=sp), rank)
        for kv in (4, 1):  # kv heads split over tp, or shared by the tp ranks
            measured, cfg = per_layer_measured([f"--model.num_kv_heads={kv}"], mesh)
            out.append((measured, activation_bytes_per_layer(cfg, BATCH, SEQ, world_size, sp)))
    return out


@pytest.mark.slow
def test_formula_matches_under_tensor_and_sequence_parallelism():
    for rank_result in run_distributed(tp_measurements, 2):
        for measured, formula in rank_result:
            assert measured == formula
