"""AdamW with weight decay on matrices only (norms, biases and nothing 1-D decay-free)."""

from __future__ import annotations

import torch
from torch import nn

from meshtron.config import TrainConfig


def build_adamw(model: nn.Module, t: TrainConfig, *, fused: bool = False) -> torch.optim.AdamW:
    """torch's AdamW, by default its foreach implementation (several passes over the tensors
    per step); ``fused``: its fused kernel, one pass per tensor (CPU and GPUs), the same update
    up to rounding."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kernel = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **kernel)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
