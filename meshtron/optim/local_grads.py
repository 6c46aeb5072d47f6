"""Gradients of a one-process fp32 run: left in ``.grad``, where autograd puts them.

With a single rank there is nothing to reduce, so :class:`GradReducer`'s buckets would only
cost time: zeroing a flat buffer every step, a Python hook per parameter that adds each fresh
gradient into it and frees it (so the allocator hands the next forward fresh pages to fault
in), and the copy itself. Here autograd keeps the gradients (it takes the first micro-batch's
tensor as is and adds later ones in place, as a bucket would), the norm is
:func:`sum_of_squares` over them, clipping one ``_foreach_mul_``, and torch's AdamW reads
``.grad`` directly.

The numbers are those of the bucket path: the same gradients element for element (a bucket
starts from zeros and adds the same tensors in the same order), zeros for parameters that got
no gradient (AdamW still steps them, as it steps their bucket slices), the same clip factor
applied the same way; only the norm's sum runs in another order (~1e-7 relative in fp32).
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.optim.grad_buckets import Bucket, assign_buckets, sum_of_squares
from meshtron.parallel.mesh.groups import Group


class LocalGradients:
    """The :class:`GradReducer` interface over ``.grad`` for a run of one process: every group
    has one rank and every parameter one copy, so nothing is reduced, synced or weighted."""

    def __init__(self, params: list[nn.Parameter], group: Group, *, dtype: torch.dtype):
        if group.pg is not None:
            raise ValueError("local gradients are for a data-parallel group of one rank")
        self.group = group
        self.zero_stage = 0
        self.dtype = dtype
        self.params = params
        self.buckets: list[Bucket] = assign_buckets(list(reversed(params)), 2**62, group,
                                                    torch.empty((), dtype=dtype).element_size())
        """One bucket per kind of parameter (decay or not), holding no buffer: what the
        optimizer and the memory accounting read of the buckets."""

    def begin_micro_batch(self, last: bool) -> None:
        """Autograd accumulates over micro-batches by itself."""

    def end_micro_batch(self) -> None:
        """Nothing in flight."""

    def zero_grad(self) -> None:
        """The optimizer sets every ``.grad`` to None: autograd then takes the first
        micro-batch's gradient without a copy."""

    def sync_replicated(self) -> None:
        """No other rank holds a copy. Parameters that got no gradient (unused in this step's
        forward) get zeros, as their bucket slice would hold."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def grad_norm_squared(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum of squared gradients (dense), and zero for the experts' own groups (one rank)."""
        total = sum_of_squares(self.grads(), self.dtype)
        return total, torch.zeros((), dtype=self.dtype, device=total.device)

    def scale_(self, factor: float) -> None:
        """Multiply every gradient by ``factor`` (an fp32 scalar, as the buckets use)."""
        grads = self.grads()
        if grads:
            torch._foreach_mul_(grads, torch.tensor(factor, dtype=self.dtype,
                                                    device=grads[0].device))

    def point_param_grads(self) -> None:
        """The gradients already are in ``.grad``."""

    def grad_bytes(self) -> int:
        """Bytes of the gradients, which live from backward to the next step's zero_grad."""
        return sum(p.numel() * p.element_size() for p in self.params)
