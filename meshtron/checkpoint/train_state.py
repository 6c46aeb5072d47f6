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

import torch
from torch import nn

from meshtron.checkpoint.store import load_tensors
from meshtron.errors import MeshtronError
from meshtron.optim.data_parallel import DataParallelOptimizer
from meshtron.parallel.mesh import ParallelMesh
from meshtron.parallel.tensor import gather_full


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


def global_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """This rank's parameters under their global names (a pipeline stage's copy of a tied
    embedding is named after the embedding)."""
    return {getattr(p, "global_name", n): p for n, p in model.named_parameters()}


def merge_stages(tensors: dict[str, torch.Tensor], mesh: ParallelMesh) -> dict[str, torch.Tensor]:
    """Every pipeline stage's tensors, on the first stage (others get their own back)."""
    if mesh.pp.pg is None:
        return tensors
    parts: list[dict[str, torch.Tensor]] | None = [{}] * mesh.pp.size if mesh.pp.rank == 0 else None
    torch.distributed.gather_object(tensors, parts, dst=mesh.pp.ranks[0], group=mesh.pp.pg)
    if parts is None:
        return tensors
    return {name: t for part in parts for name, t in part.items()}


def model_tensors(model: nn.Module, mesh: ParallelMesh) -> dict[str, torch.Tensor]:
    return {n: _full(p, p, mesh) for n, p in global_parameters(model).items()}


def optimizer_tensors(model: nn.Module, optimizer: DataParallelOptimizer,
                      mesh: ParallelMesh) -> dict[str, torch.Tensor]:
    states = optimizer.local_states()  # collective over dp when the state is sharded
    out: dict[str, torch.Tensor] = {}
    for name, param in global_parameters(model).items():  # every rank gathers in this order
        for key, value in sorted(states.get(id(param), {}).items()):
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            out[f"{name}.{key}"] = _full(tensor, param, mesh)
    return out


def rng_tensors() -> dict[str, torch.Tensor]:
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def capture(model: nn.Module, optimizer: DataParallelOptimizer,
            mesh: ParallelMesh) -> dict[str, dict[str, torch.Tensor]]:
    """Global tensors of the training state, complete on the first pipeline stage (a
    collective over tp, dp and pp: every rank must call it)."""
    with optimizer.full_parameters():
        weights = model_tensors(model, mesh)
    return {
        "model.safetensors": merge_stages(weights, mesh),
        "optimizer.safetensors": merge_stages(optimizer_tensors(model, optimizer, mesh), mesh),
        "rng.safetensors": rng_tensors(),
    }


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Copy the checkpoint's weights into ``model``, checking every name and shape first."""
    stored = load_tensors(path, "model.safetensors")
    params = global_parameters(model)
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


def restore(path: Path, model: nn.Module, optimizer: DataParallelOptimizer) -> None:
    """Load weights, optimizer state and RNG state saved by :func:`capture`."""
    with optimizer.full_parameters(modified=True):
        load_model_weights(path, model)
    stored = load_tensors(path, "optimizer.safetensors")
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in stored.items():
        name, state_key = key.rsplit(".", 1)
        by_param.setdefault(name, {})[state_key] = tensor
    optimizer.load_local_states({
        id(param): {k: _local(v, param) for k, v in by_param[name].items()}
        for name, param in global_parameters(model).items() if name in by_param
    })
    rng = load_tensors(path, "rng.safetensors")
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
