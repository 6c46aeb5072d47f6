"""Normalisation layers a block spec can name (LayerNorm is torch's own): RMSNorm and
Gemma's RMSNorm around 1 + offset."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNorm(torch.autograd.Function):
    """weight * x / rms(x) for x and weight of one dtype (fp32 or fp64), with a hand-written
    backward (autograd differentiates ``F.rms_norm`` op by op, which takes 1.4-2x as long on
    CPU)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        sum_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_()
        rstd = sum_sq.div_(x.shape[-1]).add_(eps).rsqrt_()
        normed = x * rstd
        ctx.save_for_backward(normed, weight, rstd)
        return normed * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        normed, weight, rstd = ctx.saved_tensors
        grad_weight = (grad * normed).flatten(0, -2).sum(0)
        grad_normed = grad * weight
        dot = (grad_normed * normed).mean(-1, keepdim=True)
        return grad_normed.sub_(normed * dot).mul_(rstd), grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.float64):
            return _RMSNorm.apply(x, self.weight, self.eps)
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) scaled by 1 + ``offset``. The parameter is the offset from
    1, as Gemma's checkpoints store it (their ``weight``), so it imports as is and starts at 0
    (see :mod:`meshtron.models.init`). In low precision the scale multiplies before the cast
    back, as transformers does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.offset = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + self.offset
        if x.dtype == scale.dtype and x.dtype in (torch.float32, torch.float64):
            return _RMSNorm.apply(x, scale, self.eps)
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (y * scale.float()).to(x.dtype)
