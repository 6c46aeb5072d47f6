"""The activation-memory formula against what autograd really keeps, with and without TP/SP."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import load_config
from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.training.memory import activation_bytes_per_layer, measure_saved_bytes
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


def test_recompute_modes_keep_less():
    cfg = load_config(overrides=["--model.vocab_size=512"]).model
    none, selective, full = (activation_bytes_per_layer(cfg, 4, 256, recompute=mode)
                             for mode in ("none", "selective", "full"))
    assert full < selective < none
    assert full == 4 * 4 * 256 * cfg.hidden_size  # one fp32 block input per layer


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
