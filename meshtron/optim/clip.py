"""Gradient clipping by a global norm (see :func:`meshtron.optim.grad_sync.global_grad_norm`)."""

from __future__ import annotations

import torch


def clip_gradients(params: list[torch.nn.Parameter], total_norm: torch.Tensor,
                   max_norm: float) -> None:
    """Scale gradients in place so their global norm is at most ``max_norm`` (0 = never)."""
    if max_norm <= 0:
        return
    scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, scale.to(grads[0].device))
