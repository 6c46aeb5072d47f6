"""Each tensor-parallel layer against its unsharded twin, and the bytes a TP step moves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.parallel.mesh.params import SliceSpec, layout_of
from meshtron.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPRegion,
    VocabParallelEmbedding,
    column_products,
    gather_full,
)
from meshtron.parallel.tensor.loss import vocab_parallel_loss_sum
from tests.distributed import run_distributed
from tests.parity import run_training, test_overrides

ATOL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=ATOL, rtol=1e-5), (a - b).abs().max()


def _load(param: torch.nn.Parameter, full: torch.Tensor) -> None:
    with torch.no_grad():
        tp_slice = layout_of(param).tp_slice
        param.copy_(tp_slice.take(full) if tp_slice is not None else full)


def _check_column(region: TPRegion, sp: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(8, 6, generator=gen), torch.randn(8, generator=gen)
    x, r = torch.randn(2, 4, 6, generator=gen), torch.randn(2, 4, 8, generator=gen)
    layer = ColumnParallelLinear(6, 8, True, region, parts=2)
    _load(layer.weight, w)
    _load(layer.bias, b)
    x_full = x.clone().requires_grad_()
    x_in = (x.chunk(region.size, dim=1)[region.group.rank] if sp else x).clone().requires_grad_()
    y = column_products(region, x_in, [layer])[0]
    spec = layout_of(layer.weight).tp_slice
    # the local output columns are this rank's slice of the full output's last dim
    _close(gather_full(y.movedim(-1, 0).contiguous(), spec, region.group).movedim(0, -1),
           F.linear(x, w, b))
    local_r = spec.take(r.movedim(-1, 0)).movedim(0, -1)
    (y * local_r).sum().backward()
    w_full, b_full = w.clone().requires_grad_(), b.clone().requires_grad_()
    (F.linear(x_full, w_full, b_full) * r).sum().backward()
    _close(layer.weight.grad, spec.take(w_full.grad))
    _close(layer.bias.grad, spec.take(b_full.grad))
    expected = x_full.grad.chunk(region.size, dim=1)[region.group.rank] if sp else x_full.grad
    _close(x_in.grad, expected)


def _check_row(region: TPRegion, sp: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(6, 8, generator=gen), torch.randn(6, generator=gen)
    x, r = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 4, 6, generator=gen)
    layer = RowParallelLinear(8, 6, True, region)
    _load(layer.weight, w)
    _load(layer.bias, b)
    rank, n = region.group.rank, region.size
    x_in = x.chunk(n, dim=-1)[rank].clone().requires_grad_()
    y = layer(x_in)
    full = F.linear(x, w, b)
    seq = (lambda t: t.chunk(n, dim=1)[rank]) if sp else (lambda t: t)
    _close(y, seq(full))
    (y * seq(r)).sum().backward()
    x_full, w_full = x.clone().requires_grad_(), w.clone().requires_grad_()
    b_full = b.clone().requires_grad_()
    (F.linear(x_full, w_full, b_full) * r).sum().backward()
    _close(layer.weight.grad, layout_of(layer.weight).tp_slice.take(w_full.grad))
    _close(x_in.grad, x_full.grad.chunk(n, dim=-1)[rank])
    bias_grad = layer.bias.grad.clone()
    if sp:  # the replicated bias saw only this rank's positions: summed over tp
        assert layout_of(layer.bias).grad_sync is region.group
        torch.distributed.all_reduce(bias_grad, group=region.group.pg)
    _close(bias_grad, b_full.grad)


def _check_embedding_and_loss(region: TPRegion, sp: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    rank, n = region.group.rank, region.size
    table = torch.randn(16, 5, generator=gen)
    tokens = torch.randint(0, 13, (2, 4), generator=gen)
    emb = VocabParallelEmbedding(16, 5, region)
    _load(emb.weight, table)
    out = emb(tokens)
    full = F.embedding(tokens, table)
    _close(out, full.chunk(n, dim=1)[rank] if sp else full)

    logits = torch.randn(8, 16, generator=gen)
    targets = torch.randint(0, 13, (8,), generator=gen)
    local = logits.chunk(n, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_loss_sum(local, targets, region.group, rank * 16 // n, 13)
    full_logits = logits.clone().requires_grad_()
    expected = F.cross_entropy(full_logits[:, :13], targets, reduction="sum")
    expected.backward()
    _close(loss, expected.detach())
    loss.backward()
    _close(local.grad, full_logits.grad.chunk(n, dim=-1)[rank])


def layer_checks(rank: int, world_size: int) -> None:
    mesh = ParallelMesh(MeshLayout(world_size, tp=world_size), rank)
    for sp in (False, True):
        region = TPRegion(mesh.tp, sp)
        _check_column(region, sp)
        _check_row(region, sp)
        _check_embedding_and_loss(region, sp)
    overlapped = TPRegion(mesh.tp, True, overlap_chunks=2)  # one row per piece
    _check_column(overlapped, True)
    _check_row(overlapped, True)


@pytest.mark.slow
def test_layers_match_their_unsharded_twins():
    run_distributed(layer_checks, 2)


def test_shard_spec_slices_fused_blocks():
    full = torch.arange(16.0).view(8, 2)  # [gate (4 rows) | up (4 rows)]
    spec = SliceSpec(dim=0, index=1, count=2, parts=2)
    assert spec.take(full)[:, 0].tolist() == [4.0, 6.0, 12.0, 14.0]
    assert spec.local_shape((8, 2)) == (4, 2)


def comm_volume(rank: int, world_size: int, cache_dir: str, root: str) -> list[dict]:
    rows = []
    for sp, overlap, compiled in ((False, False, False), (True, False, False),
                                  (True, True, False), (True, True, True)):
        run_dir = f"{root}/sp{sp}-{overlap}-{compiled}"
        run_training(test_overrides(cache_dir, run_dir, steps=1) +
                     ["--parallel.tp=2", f"--parallel.sp={sp}", "--train.log_every=1",
                      f"--parallel.tp_comm_overlap={overlap}", f"--train.compile={compiled}"],
                     rank, world_size)
        if rank == 0:
            rows.append(json.loads(Path(run_dir, "metrics.jsonl").read_text().splitlines()[0]))
    return rows


@pytest.mark.slow
def test_bytes_per_step_follow_the_closed_form(data_cache, tmp_path):
    rows = run_distributed(comm_volume, 2, data_cache, str(tmp_path))[0]
    layers, b, s, h, fp32 = 2, 8, 32, 64, 4
    activation = b * s * h * fp32  # one [b, s, h] buffer
    # ring bytes per rank for n=2: all-reduce sends X, all-gather/reduce-scatter X/2
    loss_reductions = 3 * b * s * fp32  # max, sum of exp, target logit per token
    no_sp = rows[0]["comm_bytes"]
    # forward: embedding + 2 per layer; backward: 2 per layer + the output layer's input
    assert no_sp["tp/all_reduce"] == (4 * layers + 2) * activation + loss_reductions
    assert no_sp["model/all_reduce"] == fp32  # the grad-norm scalar
    sp = rows[1]["comm_bytes"]
    assert sp["tp/all_gather"] == sp["tp/reduce_scatter"] == (4 * layers + 2) * activation // 2
    norm_weights = (2 * layers + 1) * h * fp32  # replicated norms summed over tp under SP
    assert sp["tp/all_reduce"] == loss_reductions + norm_weights
    assert sp["tp/all_gather"] + sp["tp/reduce_scatter"] == no_sp["tp/all_reduce"] - (
        loss_reductions)
    assert rows[2]["comm_bytes"] == sp  # overlapped in pieces, the same bytes
    assert rows[3]["comm_bytes"] == sp  # compiled: the collectives stay outside the graphs
