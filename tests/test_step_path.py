"""The one-process step path: gradients left in ``.grad`` (no buckets, no hooks) give the
bucket path's gradients element for element, and the norm that clipping reads stays accurate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshtron.config import load_config
from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer
from meshtron.optim.data_parallel import ReplicatedOptimizer, build_optimizer
from meshtron.optim.grad_buckets import GradReducer, sum_of_squares
from meshtron.optim.local_grads import LocalGradients
from meshtron.parallel.context.sequence import SequenceSplit
from meshtron.parallel.mesh import ParallelMesh
from meshtron.parallel.mesh.params import ParamLayout, set_layout
from meshtron.plan import plan_run
from meshtron.rank import rank_with
from meshtron.training.step import micro_batches, train_step
from tests.parity import test_overrides

BATCH, SEQ = 4, 32


def twin_models(dtype: torch.dtype = torch.float32) -> tuple[Transformer, Transformer, object]:
    cfg = load_config(overrides=test_overrides("unused", "unused") + [
        "--model.vocab_size=512", f"--train.global_batch={BATCH}",
        f"--train.micro_batch={BATCH // 2}"])
    models = []
    for _ in range(2):
        model = Transformer(cfg.model)
        initialize(model, seed=0, std=0.02, num_layers=cfg.model.num_layers)
        models.append(model.to(dtype).train())
    return models[0], models[1], cfg


def windows(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 512, (BATCH, SEQ + 1), generator=g) for _ in range(steps)]


def test_one_process_fp32_keeps_no_buckets_and_no_hooks():
    model, _, cfg = twin_models()
    optimizer = build_optimizer(model, ParallelMesh.single(), cfg.train, zero=2, bucket_mb=0.01)
    assert isinstance(optimizer.reducer, LocalGradients) and optimizer.zero_stage == 0
    assert all(b.grad is None and b.shard_grad is None for b in optimizer.reducer.buckets)
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert sum(b.padded for b in optimizer.reducer.buckets) == n
    assert optimizer.memory_bytes()["grads"] == 4 * n  # in .grad from backward to zero_grad


@pytest.mark.parametrize("dtype, reduce_dtype", [(torch.float64, None),
                                                 (torch.float32, torch.bfloat16)])
def test_other_one_process_runs_keep_the_buckets(dtype, reduce_dtype):
    """fp64 verification runs, and gradients reduced in another dtype (rounded as a
    multi-rank run rounds them)."""
    model, _, cfg = twin_models(dtype)
    optimizer = build_optimizer(model, ParallelMesh.single(), cfg.train, zero=0, bucket_mb=25.0,
                                reduce_dtype=reduce_dtype)
    assert isinstance(optimizer.reducer, GradReducer)


def test_local_gradients_equal_the_buckets_element_for_element():
    """Two micro-batches accumulated: autograd's ``.grad`` against a bucket that started at
    zero; then whole steps agree (the norm's sum only runs in another order)."""
    local_model, bucket_model, cfg = twin_models()
    mesh, split = ParallelMesh.single(), SequenceSplit(ParallelMesh.single().cp)
    local = build_optimizer(local_model, mesh, cfg.train, zero=0, bucket_mb=0.01)
    bucketed = ReplicatedOptimizer(bucket_model, mesh, cfg.train, bucket_mb=0.01)
    assert isinstance(bucketed.reducer, GradReducer) and len(bucketed.reducer.buckets) > 2
    window = windows(1)[0]
    for model, optimizer in ((local_model, local), (bucket_model, bucketed)):
        optimizer.zero_grad()
        chunks = micro_batches(window, BATCH // 2, split)
        for i, mb in enumerate(chunks):
            optimizer.begin_micro_batch(last=i == len(chunks) - 1)
            (model.loss_sum(model(mb.tokens), mb.targets) / (BATCH * SEQ)).backward()
            optimizer.end_micro_batch()
        optimizer.finish_gradients()
    bucketed.reducer.point_param_grads()
    for (name, ours), theirs in zip(local_model.named_parameters(), bucket_model.parameters()):
        assert torch.equal(ours.grad, theirs.grad), name
    norms = [float(o.grad_norm()) for o in (local, bucketed)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)

    plan = plan_run(cfg, 1)  # twin models, one per gradient path: each a rank of one plan
    ranks = [rank_with(plan, m, o) for m, o in ((local_model, local), (bucket_model, bucketed))]
    for window in windows(3):
        out = [train_step(rank, window, lr=3e-3) for rank in ranks]
        assert out[0].loss == pytest.approx(out[1].loss, rel=1e-6)
        assert out[0].grad_norm == pytest.approx(out[1].grad_norm, rel=1e-6)
    with torch.no_grad():  # Adam magnifies last-bit differences of near-zero gradients
        delta = sum(float((a - b).double().square().sum())
                    for a, b in zip(local_model.parameters(), bucket_model.parameters()))
        total = sum(float(a.double().square().sum()) for a in bucket_model.parameters())
    assert (delta / total) ** 0.5 < 1e-5


def test_a_parameter_without_gradient_gets_zeros_as_its_bucket_slice_would():
    model = nn.Linear(4, 3)
    unused = nn.Parameter(torch.ones(5))
    params = [model.weight, model.bias, unused]
    for param in params:
        set_layout(param, ParamLayout(tuple(param.shape)))
    grads = LocalGradients(params, ParallelMesh.single().dp_cp, dtype=torch.float32)
    model(torch.randn(2, 4)).sum().backward()
    grads.sync_replicated()
    assert torch.equal(unused.grad, torch.zeros(5))
    expected = sum(float(p.grad.double().square().sum()) for p in params)
    assert float(grads.grad_norm_squared()[0]) == pytest.approx(expected, rel=1e-6)
    grads.scale_(0.5)
    assert torch.equal(model.bias.grad, torch.full((3,), 1.0))


def test_sum_of_squares_is_as_accurate_as_square_sum():
    """Millions of fp32 elements of mixed magnitude: one vector_norm drifts by ~1e-4 there."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2_000_003, generator=g) * 1e-3, torch.randn(700, 300, generator=g),
               torch.randn(17, generator=g) * 10, torch.randn(4096, generator=g)]
    exact = sum(float(t.double().square().sum()) for t in tensors)
    assert float(sum_of_squares(tensors, torch.float32)) == pytest.approx(exact, rel=1e-6)
    assert float(sum_of_squares(tensors, torch.float64)) == pytest.approx(exact, rel=1e-12)
    assert float(sum_of_squares([], torch.float32)) == 0.0
