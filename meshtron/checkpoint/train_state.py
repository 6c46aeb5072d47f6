"""The training state in a checkpoint: this rank's pieces out, any layout's pieces back in.

Saving: every rank captures the pieces of the global tensors it writes (see
:mod:`meshtron.checkpoint.held`: model parameters, AdamW moments, fp32 masters when the
parameters are not fp32), copied to host memory. The optimizer's step count, the loss scale and
the data position go into the manifest; each rank's RNG state into its shard.

Loading: every rank asks the index for the boxes of the global tensors it holds under *its*
layout and reads only those slices, whatever layout wrote them. Shapes are checked for every
tensor before anything is copied, so a mismatched checkpoint changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtron.checkpoint.held import Held, held_tensors
from meshtron.checkpoint.shards import DTYPES, Piece, ShardReader
from meshtron.checkpoint.store import open_checkpoint
from meshtron.errors import MeshtronError
from meshtron.optim.data_parallel import DataParallelOptimizer
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.mesh.params import global_names
from meshtron.precision.policy import LossScaler


@torch.no_grad()
def capture(model: nn.Module, optimizer: DataParallelOptimizer, mesh: ParallelMesh,
            buffers: dict[tuple, torch.Tensor] | None = None) -> list[Piece]:
    """Host copies of the pieces this rank writes (no communication). With ``buffers`` (kept
    by the caller between saves, and not in use by a save still being written) the copies go
    into the same host tensors every time instead of new ones."""
    pieces = []
    for held in held_tensors(model, optimizer, mesh):
        if not held.writes:
            continue
        for local_box, global_box in held.boxes():
            source = held.view(local_box)
            key = (held.name, global_box)
            data = buffers.get(key) if buffers is not None else None
            if data is None or data.dtype != source.dtype:
                data = torch.empty(source.shape, dtype=source.dtype, device="cpu")
                if buffers is not None:
                    buffers[key] = data
            data.copy_(source)
            pieces.append(Piece(held.name, held.global_shape, global_box, data))
    return pieces


def state_meta(optimizer: DataParallelOptimizer, scaler: LossScaler | None) -> dict[str, Any]:
    """The manifest's part of the training state: optimizer steps and the fp16 loss scale."""
    meta: dict[str, Any] = {"optimizer": {"steps": optimizer.steps_taken}}
    if scaler is not None:
        meta["loss_scale"] = [scaler.scale, scaler.clean_steps]
    return meta


def _check_shapes(path: Path, reader: ShardReader, helds: list[Held]) -> None:
    for held in helds:
        if held.name.startswith("model/") and not reader.has(held.name):
            raise MeshtronError(f"checkpoint {path} lacks {held.name[6:]} of this model")
        if reader.has(held.name) and reader.shape(held.name) != held.global_shape:
            raise MeshtronError(
                f"checkpoint {path}: {held.name} has shape {list(reader.shape(held.name))}, "
                f"this model expects {list(held.global_shape)}")


@torch.no_grad()
def _load(reader: ShardReader, helds: list[Held]) -> None:
    for held in helds:
        name = held.name if reader.has(held.name) else held.fallback
        if name is None or not reader.has(name):
            continue
        dtype = DTYPES[reader.tensors[name]["dtype"]]
        for local_box, global_box in held.boxes():
            buffer = torch.empty(global_box[1], dtype=dtype)
            reader.read_into(name, global_box, buffer)
            held.view(local_box).copy_(buffer)


@torch.no_grad()
def load_weights(path: Path, model: nn.Module) -> None:
    """Only the parameters, into a one-process model (inference, conversion)."""
    _, reader = open_checkpoint(path)
    names = global_names(model)
    helds = [Held(f"model/{names[id(p)]}", p, tuple(p.shape), p.data.view(-1), 0, True)
             for p in model.parameters()]
    _check_shapes(path, reader, helds)
    _load(reader, helds)


def restore(path: Path, manifest: dict[str, Any], reader: ShardReader, model: nn.Module,
            optimizer: DataParallelOptimizer, mesh: ParallelMesh,
            scaler: LossScaler | None = None) -> None:
    """Parameters, optimizer state, the loss scale and this rank's RNG state, resharded to
    this layout. Optimizer state absent from the checkpoint (a converted model) starts from
    zero."""
    optimizer.init_state()
    helds = held_tensors(model, optimizer, mesh)
    _check_shapes(path, reader, helds)
    model_helds = [h for h in helds if h.name.startswith("model/")]
    _load(reader, model_helds)
    optimizer.masters_from_params()
    _load(reader, [h for h in helds if not h.name.startswith("model/")])
    optimizer.steps_taken = int(manifest.get("optimizer", {}).get("steps", 0))
    if scaler is not None and "loss_scale" in manifest:
        scaler.scale, scaler.clean_steps = manifest["loss_scale"]
    rng = manifest.get("rng", {})
    key = rng.get(str(mesh.global_rank)) or rng.get("0")
    if key is not None:
        torch.set_rng_state(reader.read_rng(key))
