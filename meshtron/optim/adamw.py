"""AdamW with weight decay on matrices only (norms, biases and nothing 1-D decay-free), and
muP's per-parameter learning-rate multipliers (:func:`~meshtron.models.init.lr_multipliers`) as
param groups of their own, each group's ``lr_mult`` applied on top of the scheduled rate and its
weight decay divided by it (so that the decay per step, lr x wd, does not shrink with width: the
choice of the ``mup`` package's MuAdamW)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from meshtron.config import TrainConfig
from meshtron.models.init import lr_multipliers


def _undecorated(method: Any) -> Any:
    """torch's implementation under its ``torch.compile`` wrapper (itself where there is none)."""
    return getattr(method, "__wrapped__", method)


_STEP = _undecorated(torch.optim.AdamW.step)
_ADD_PARAM_GROUP = _undecorated(Optimizer.add_param_group)
_STATE_DICT = _undecorated(Optimizer.state_dict)
_LOAD_STATE_DICT = _undecorated(Optimizer.load_state_dict)
_ZERO_GRAD = _undecorated(Optimizer.zero_grad)


class EagerAdamW(torch.optim.AdamW):
    """torch's AdamW, the same update by the same kernels, called past the wrappers that make
    it safe inside ``torch.compile``: each of them imports ``torch._dynamo`` on first use,
    1.5-1.7 s of start-up per process (measured on this CPU), and meshtron never compiles an
    optimizer step. The step runs under ``no_grad``, as torch's wrapper would run it."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return _STEP(self, closure)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _ADD_PARAM_GROUP(self, param_group)

    def state_dict(self) -> dict[str, Any]:
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _LOAD_STATE_DICT(self, state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _ZERO_GRAD(self, set_to_none)


def build_adamw(model: nn.Module, t: TrainConfig, *, fused: bool = False) -> torch.optim.AdamW:
    """torch's AdamW, by default its foreach implementation (several passes over the tensors
    per step); ``fused``: its fused kernel, one pass per tensor (CPU and GPUs), the same update
    up to rounding."""
    mults = lr_multipliers(model)
    groups = []
    for decay in (True, False):
        params = [p for p in model.parameters() if p.requires_grad and (p.dim() >= 2) == decay]
        by_mult: dict[float, list[nn.Parameter]] = {1.0: []}  # the plain group always
        for param in params:
            by_mult.setdefault(mults.get(id(param), 1.0), []).append(param)
        for mult, members in by_mult.items():
            if members or mult == 1.0:
                group = {"params": members, "weight_decay": t.weight_decay if decay else 0.0}
                if mult != 1.0:  # decay per step lr x wd stays the base's, as in mup's MuAdamW
                    group.update(lr=t.lr * mult, lr_mult=mult,
                                 weight_decay=group["weight_decay"] / mult)
                groups.append(group)
    kernel = {"fused": True} if fused else {"foreach": True}
    return EagerAdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **kernel)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The scheduled rate ``lr`` on every group, times the group's ``lr_mult`` (muP)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_mult"] if "lr_mult" in group else lr
