"""Small pieces of autograd the model layers share: whether the engine is inside a backward pass
(a forward recomputed by activation checkpointing runs inside one, and hooks must behave
differently there), and losses attached to an activation rather than added to the objective."""

import torch


def in_backward() -> bool:
    """True while autograd executes a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class _AttachLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, ``loss`` receives the gradient ``weight``, as if
    ``weight * loss`` had been added to the objective."""

    @staticmethod
    def forward(ctx, out, loss, weight):
        ctx.weight = weight
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full(ctx.loss_shape, ctx.weight, dtype=ctx.loss_dtype), None


def attach_loss(out: torch.Tensor, loss: torch.Tensor, weight: float) -> torch.Tensor:
    """``out`` unchanged, with ``weight * loss`` joining the objective when backward reaches
    it: an auxiliary loss (MoE balancing, multi-token prediction) without changing what the
    training loop backpropagates."""
    return _AttachLoss.apply(out, loss, weight)
