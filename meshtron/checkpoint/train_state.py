"""What a training checkpoint holds, as flat name -> tensor maps keyed by global names.

Tensors are stored whole (gathered over tensor-parallel ranks) and each rank takes its slice on
load, so a checkpoint written under one tp/dp layout resumes under any other.

``model.safetensors``      every parameter under its global name
``optimizer.safetensors``  ``<name>.<state>`` for each optimizer state tensor (e.g. exp_avg)
``rng.safetensors``        generator states, so anything random continues identically

The step and the data position live in the manifest: the sampler is a pure function of
(seed, step), so the step alone says which samples come next.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtron.checkpoint.store import load_tensors
from meshtron.errors import MeshtronError
from meshtron.parallel.mesh import ParallelMesh
from meshtron.parallel.tensor import gather_full


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _full(tensor: torch.Tensor, param: nn.Parameter, mesh: ParallelMesh) -> torch.Tensor:
    """The global value of ``tensor`` (a parameter or a state of the same shape)."""
    if tensor.shape != param.shape:  # a scalar state such as Adam's step
        return tensor.detach()
    return gather_full(tensor.detach(), getattr(param, "shard", None), mesh.tp)


def _local(full: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    shard = getattr(param, "shard", None)
    if shard is None or full.dim() == 0:
        return full
    return shard.take(full)


def model_tensors(model: nn.Module, mesh: ParallelMesh) -> dict[str, torch.Tensor]:
    return {n: _full(p, p, mesh) for n, p in model.named_parameters()}


def optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer,
                      mesh: ParallelMesh) -> dict[str, torch.Tensor]:
    names = _param_names(model)
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:  # a fixed order: every rank gathers alike
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                tensor = value if torch.is_tensor(value) else torch.tensor(value)
                out[f"{names[id(param)]}.{key}"] = _full(tensor, param, mesh)
    return out


def rng_tensors() -> dict[str, torch.Tensor]:
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def capture(model: nn.Module, optimizer: torch.optim.Optimizer,
            mesh: ParallelMesh) -> dict[str, dict[str, torch.Tensor]]:
    """Global tensors of the training state (a collective over tp: every rank must call it)."""
    return {
        "model.safetensors": model_tensors(model, mesh),
        "optimizer.safetensors": optimizer_tensors(model, optimizer, mesh),
        "rng.safetensors": rng_tensors(),
    }


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Copy the checkpoint's weights into ``model``, checking every name and shape first."""
    stored = load_tensors(path, "model.safetensors")
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(stored))
    if missing:
        raise MeshtronError(f"checkpoint {path} lacks parameter {missing[0]} of this model")
    for name, param in params.items():
        expected = tuple(getattr(param, "global_shape", param.shape))
        if tuple(stored[name].shape) != expected:
            raise MeshtronError(
                f"checkpoint {path}: parameter {name} has shape {tuple(stored[name].shape)}, "
                f"this model expects {expected}"
            )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(_local(stored[name], param))


def restore(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load weights, optimizer state and RNG state saved by :func:`capture`."""
    load_model_weights(path, model)
    stored = load_tensors(path, "optimizer.safetensors")
    names = _param_names(model)
    by_param: dict[str, dict[str, Any]] = {}
    for key, tensor in stored.items():
        name, state_key = key.rsplit(".", 1)
        by_param.setdefault(name, {})[state_key] = tensor
    state_dict = optimizer.state_dict()
    index = 0
    state_dict["state"] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            saved = by_param.get(names[id(param)])
            if saved is not None:
                state_dict["state"][index] = {k: _local(v, param) for k, v in saved.items()}
            index += 1
    optimizer.load_state_dict(state_dict)
    rng = load_tensors(path, "rng.safetensors")
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
