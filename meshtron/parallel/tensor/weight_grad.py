"""Split backward for zero-bubble pipelines: input gradients now, weight gradients later.

A linear layer's backward is two products: ``grad_x = grad_y @ W`` (needed at once by the
previous stage) and ``grad_W = grad_y^T @ x`` (needed only by the optimizer). While a
:class:`WeightGradStore` is ``deferring``, the linear layers of a model compute ``grad_x`` and
put ``(W, x, grad_y)`` aside; :meth:`WeightGradStore.run` later forms the weight gradients and
hands them to autograd, which accumulates them into ``.grad`` exactly as a normal backward
would (gradient hooks included). Norm weights and biases, which are cheap, keep their gradient
in the first part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Deferred = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(weight, saved input, output gradient) of one deferred product."""


class WeightGradStore:
    def __init__(self) -> None:
        self.deferring = False
        self.pending: list[Deferred] = []

    def defer(self, weight: torch.Tensor, x: torch.Tensor, grad_y: torch.Tensor) -> bool:
        """Hook for FP8 layers: take ``grad_y^T x`` for later while deferring."""
        if self.deferring:
            self.pending.append((weight, x, grad_y))
        return self.deferring

    def take(self) -> list[Deferred]:
        """The products put aside since the last call."""
        out, self.pending = self.pending, []
        return out

    @staticmethod
    def run(products: list[Deferred]) -> None:
        """Compute the weight gradients of ``products`` and accumulate them into the weights."""
        if not products:
            return
        weights, grads = [], []
        for weight, x, grad_y in products:
            x2 = x.reshape(-1, x.shape[-1]).to(grad_y.dtype)
            grads.append((grad_y.reshape(-1, grad_y.shape[-1]).t() @ x2).to(weight.dtype))
            weights.append(weight)
        torch.autograd.backward(weights, grads)


class LinearSplitBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                store: WeightGradStore) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.store = store
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_y @ weight.to(grad_y.dtype)
        grad_b = grad_y.reshape(-1, grad_y.shape[-1]).sum(0) if ctx.has_bias else None
        if not ctx.needs_input_grad[1]:  # a frozen weight (LoRA's base, its tied head)
            return grad_x, None, grad_b, None
        if ctx.store.deferring:
            ctx.store.pending.append((weight, x, grad_y))
            return grad_x, None, grad_b, None
        x2 = x.reshape(-1, x.shape[-1]).to(grad_y.dtype)
        grad_w = (grad_y.reshape(-1, grad_y.shape[-1]).t() @ x2).to(weight.dtype)
        return grad_x, grad_w, grad_b, None
