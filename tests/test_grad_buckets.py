"""Gradient memory of ZeRO-2/3 buckets: made when a step produces it, dropped by ``zero_grad``.

One process, a one-rank group (no communication): the lifetimes and values of the buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.optim.grad_buckets import GradReducer
from meshtron.parallel.mesh.groups import CommStats, Group
from meshtron.parallel.mesh.params import ParamLayout, set_layout


def reducer_of(stage: int) -> tuple[nn.Sequential, GradReducer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False))
    group = Group("dp_cp", [0], 0, None, CommStats())
    params = [set_layout(p, ParamLayout(tuple(p.shape))) for p in model.parameters()]
    return model, GradReducer(params, group, zero_stage=stage, bucket_bytes=2**20,
                              dtype=torch.float32, units=[params] if stage == 3 else None)


def reference(model: nn.Sequential, batches: list[torch.Tensor]) -> torch.Tensor:
    """The bucket's flat gradient by plain autograd (``autograd.grad`` runs no accumulation
    hooks), summed over ``batches`` in order."""
    params = list(reversed(list(model.parameters())))  # the bucket's (gradient-ready) order
    total = None
    for x in batches:
        grads = torch.autograd.grad(model(x).square().sum(), params)
        flat = torch.cat([g.reshape(-1) for g in grads])
        total = flat if total is None else total + flat
    return total


def test_a_bucket_is_flattened_at_its_last_gradient_and_zero_grad_drops_it():
    model, reducer = reducer_of(3)
    (bucket,) = reducer.buckets
    assert bucket.grad is None and bucket.shard_grad is None  # nothing before the first step
    assert reducer.grad_bytes() == 4 * bucket.padded  # kept from a backward to zero_grad
    seen = []
    reducer.on_launch = lambda b: seen.append(b.grad is not None)
    model[0].weight.register_hook(lambda g: seen.append(bucket.grad is None) or g)
    x = torch.randn(3, 8)
    reducer.begin_micro_batch(last=True)
    model(x).square().sum().backward()
    reducer.end_micro_batch()
    # the second layer's gradient waited in the bucket; the flat buffer came at the last one
    assert seen == [True, True] and bucket.pending == [] and bucket.grad is None
    assert torch.equal(reducer.local_grad(bucket), reference(model, [x]))
    reducer.zero_grad()
    assert bucket.shard_grad is None


def test_micro_batches_accumulate_into_the_chunk_made_by_the_first():
    model, reducer = reducer_of(2)
    batches = [torch.randn(3, 8), torch.randn(5, 8)]
    for i, x in enumerate(batches):
        reducer.begin_micro_batch(last=i == len(batches) - 1)
        model(x).square().sum().backward()
        reducer.end_micro_batch()
    assert torch.equal(reducer.local_grad(reducer.buckets[0]), reference(model, batches))
