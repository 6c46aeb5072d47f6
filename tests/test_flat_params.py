"""ZeRO-3's flat parameter buffers: what freeing a unit releases while autograd still holds
views of its weights, and that backward then reads the gathered values again."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.optim.flat_params import FlatParams
from meshtron.optim.grad_buckets import assign_buckets
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.mesh.params import ParamLayout, set_layout


def test_freeing_releases_the_storage_of_weight_views_saved_for_backward():
    torch.manual_seed(0)
    weight = set_layout(nn.Parameter(torch.randn(64, 16)), ParamLayout((64, 16)))
    reference = weight.detach().clone()
    (bucket,) = assign_buckets([weight], 2**20, ParallelMesh.single().dp_cp, 4)
    flat = FlatParams(bucket, sharded=True)
    assert flat.buffer.untyped_storage().nbytes() == 0  # nothing gathered yet

    x = torch.randn(8, 16, requires_grad=True)
    flat.wait_gather()
    gate, up = (F.linear(x, w) for w in weight.chunk(2))  # saves views of the weight
    loss = (F.silu(gate) * up).sum()
    flat.free()
    # the saved views no longer keep the unit's gathered buffer alive
    assert flat.buffer.untyped_storage().nbytes() == 0 and weight.numel() == 0

    flat.wait_gather()  # as the unit's backward pre-hook does: the same storage, refilled
    assert torch.equal(weight, reference)
    loss.backward()  # no version-counter complaint: the saved views see the same values

    x2 = x.detach().clone().requires_grad_()
    w2 = reference.clone().requires_grad_()
    g2, u2 = (F.linear(x2, w) for w in w2.chunk(2))
    (F.silu(g2) * u2).sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(weight.grad, w2.grad)
