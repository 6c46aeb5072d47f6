"""Gradient reductions after backward, and the grad norm over the whole mesh.

Two reductions make every rank's gradients equal the single-process gradient of its slice:

1. replicated parameters that saw only part of the data (norm weights under sequence
   parallelism, kv heads shared by several tp ranks) sum their gradient over ``param.grad_sync``;
2. every gradient is summed over the data-parallel ranks (dp x cp). Losses are normalised by
   the global token count, so a sum (not a mean) gives the global-batch gradient.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from meshtron.parallel.collectives import all_reduce
from meshtron.parallel.mesh import Group, ParallelMesh


def all_reduce_coalesced(tensors: list[torch.Tensor], group: Group) -> None:
    """Sum ``tensors`` over ``group`` with one collective on a flat buffer."""
    if group.pg is None or not tensors:
        return
    flat = all_reduce(torch.cat([t.reshape(-1) for t in tensors]), group)
    for t, reduced in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(reduced.view_as(t))


@torch.no_grad()
def sync_gradients(params: list[torch.nn.Parameter], mesh: ParallelMesh) -> None:
    groups: dict[int, Group] = {}
    grads: dict[int, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        group = getattr(p, "grad_sync", None)
        if group is not None and p.grad is not None:
            groups[id(group)] = group
            grads[id(group)].append(p.grad)
    for key, group in groups.items():
        all_reduce_coalesced(grads[key], group)
    all_reduce_coalesced([p.grad for p in params if p.grad is not None], mesh.dp_cp)


@torch.no_grad()
def global_grad_norm(params: list[torch.nn.Parameter], mesh: ParallelMesh) -> torch.Tensor:
    """sqrt of the sum of squared gradients over the model, each replicated copy once."""
    with_grad = [p for p in params if p.grad is not None]
    norms = torch.stack(torch._foreach_norm([p.grad.float() for p in with_grad]))
    weights = torch.tensor([1.0 / getattr(p, "replicas", 1) for p in with_grad],
                           device=norms.device)
    total = (norms.square() * weights).sum()
    return all_reduce(total, mesh.model).sqrt()
