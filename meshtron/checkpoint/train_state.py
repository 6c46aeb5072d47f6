"""The training state in a checkpoint: this rank's pieces out, any layout's pieces back in.

Saving: every rank captures the pieces of the global tensors it writes (see
:mod:`meshtron.checkpoint.held`: model parameters, AdamW moments, fp32 masters when the
parameters are not fp32), copied to host memory. The optimizer's step count, the loss scale and
the data position go into the manifest; each rank's RNG state into its shard.

Loading: every rank asks the index for the boxes of the global tensors it holds under *its*
layout and reads only those slices, whatever layout wrote them, straight into its own tensors.
Shapes are checked for every tensor before anything is copied, so a mismatched checkpoint
changes nothing. Checksums are computed beside the copies and checked before the weights are
used (a corrupt file raises after the tensors it fed were overwritten: the run stops there).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtron.checkpoint.held import Held, held_tensors
from meshtron.checkpoint.lora_state import is_adapted, restore_base
from meshtron.checkpoint.shards import DTYPES, Piece, ShardReader, check_finite
from meshtron.checkpoint.store import open_checkpoint
from meshtron.errors import MeshtronError
from meshtron.optim.data_parallel import DataParallelOptimizer
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.mesh.params import global_names
from meshtron.precision.policy import LossScaler

Log = Callable[[str], None]


@torch.no_grad()
def capture(model: nn.Module, optimizer: DataParallelOptimizer, mesh: ParallelMesh,
            buffers: dict[tuple, torch.Tensor] | None = None, copy: bool = True) -> list[Piece]:
    """Host copies of the pieces this rank writes (no communication). With ``buffers`` (kept
    by the caller between saves, and not in use by a save still being written) the copies go
    into the same host tensors every time instead of new ones. ``copy=False`` is for a save
    that is written before training goes on: pieces already in host memory are written from
    where they live (as ``torch.distributed.checkpoint`` does), the rest copied."""
    pieces = []
    for held in held_tensors(model, optimizer, mesh):
        if not held.writes:
            continue
        for local_box, global_box in held.boxes():
            source = held.view(local_box)
            if not copy and source.device.type == "cpu":
                pieces.append(Piece(held.name, held.global_shape, global_box, source))
                continue
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
        assert name is not None and reader.has(name), "_optimizer_helds decided what to load"
        for local_box, global_box in held.boxes():
            reader.read_into(name, global_box, held.view(local_box))


def _exact_master_source(reader: ShardReader, held: Held) -> bool:
    """The saved parameter can stand in for a missing master: it was saved in full precision
    (a checkpoint of an fp32 run resumed in bf16 or fp16)."""
    name = held.fallback
    return (name is not None and reader.has(name)
            and DTYPES[reader.tensors[name]["dtype"]] in (torch.float32, torch.float64))


def _optimizer_helds(path: Path, reader: ShardReader, helds: list[Held], log: Log) -> list[Held]:
    """The optimizer state to load, each gap an explicit decision: a checkpoint of weights
    only (a converted model) starts the moments at zero, said in the log; a master missing
    beside an fp32 parameter is that parameter, said in the log; any other gap is an error,
    since resuming would silently restart part of the state."""
    wanted = [h for h in helds if not h.name.startswith("model/")]
    if wanted and not any(name.startswith("optim/") for name in reader.tensors):
        log(f"{path} holds weights only: AdamW moments and step count start at zero, master "
            "weights from the weights")
        return [h for h in wanted if _exact_master_source(reader, h)]
    missing = [h for h in wanted if not reader.has(h.name)]
    unsound = [h.name for h in missing if not _exact_master_source(reader, h)]
    if unsound:
        more = f" and {len(unsound) - 1} more" if len(unsound) > 1 else ""
        raise MeshtronError(f"checkpoint {path} lacks {unsound[0]}{more}: resuming would restart "
                            "that optimizer state; resume from a complete checkpoint")
    if missing:
        log(f"{path} has no master weights (saved by a full-precision run): masters taken from "
            "its fp32 parameters")
    return wanted


@torch.no_grad()
def load_weights(path: Path, model: nn.Module) -> None:
    """Only the parameters, into a one-process model (inference, conversion)."""
    _, reader = open_checkpoint(path)
    names = global_names(model)
    helds = [Held(f"model/{names[id(p)]}", p, tuple(p.shape), p.data.view(-1), 0, True)
             for p in model.parameters()]
    _check_shapes(path, reader, helds)
    _load(reader, helds)
    reader.verify()


def restore(path: Path, manifest: dict[str, Any], reader: ShardReader, model: nn.Module,
            optimizer: DataParallelOptimizer, mesh: ParallelMesh,
            scaler: LossScaler | None = None, log: Log = print) -> None:
    """Parameters, optimizer state, the loss scale and this rank's RNG state, resharded to
    this layout. What the checkpoint lacks is decided in the open (see
    :func:`_optimizer_helds` and :func:`_restore_rng`). An adapted model first reads its
    frozen base (:func:`~.lora_state.restore_base`); a checkpoint that is only its base
    leaves the adapters and their state fresh."""
    optimizer.init_state()
    if is_adapted(model) and not restore_base(path, manifest, reader, model, log):
        optimizer.masters_from_params()
        return
    helds = held_tensors(model, optimizer, mesh)
    _check_shapes(path, reader, helds)
    weights = [h for h in helds if h.name.startswith("model/")]
    _load(reader, weights)
    reader.verify()
    for held in weights:
        check_finite(path, held.name[6:], held.flat)
    optimizer.masters_from_params()
    _load(reader, _optimizer_helds(path, reader, helds, log))
    reader.verify()
    optimizer.steps_taken = int(manifest.get("optimizer", {}).get("steps", 0))
    if scaler is not None and "loss_scale" in manifest:
        scaler.scale, scaler.clean_steps = manifest["loss_scale"]
    _restore_rng(manifest, reader, mesh, log)


def _restore_rng(manifest: dict[str, Any], reader: ShardReader, mesh: ParallelMesh,
                 log: Log) -> None:
    """This rank's saved RNG state. A rank the checkpoint has none for (it was written by
    fewer ranks) is seeded from the run's seed, the step and its rank: never another rank's
    state, which would repeat that rank's dropout masks."""
    saved = manifest.get("rng", {})
    world = mesh.layout.world_size
    if len(saved) < world:
        log(f"the checkpoint holds RNG states of {len(saved)} ranks: ranks {len(saved)} to "
            f"{world - 1} are seeded from train.seed, the step and their rank")
    key = saved.get(str(mesh.global_rank))
    if key is None:
        seed = int(manifest.get("data", {}).get("seed", 0))
        torch.manual_seed(fresh_seed(seed, int(manifest.get("step", 0)), mesh.global_rank))
    else:
        try:
            torch.set_rng_state(reader.read_rng(key))
        except RuntimeError as err:  # a uint8 tensor of another length
            raise MeshtronError(f"checkpoint {reader.path}: the RNG state of rank "
                                f"{mesh.global_rank} is unusable ({str(err)[:120]})") from None


def fresh_seed(seed: int, step: int, rank: int) -> int:
    """A seed for a rank without a saved RNG state, distinct per (seed, step, rank)."""
    return ((seed * 1_000_003 + step) * 65_537 + rank) % 2**63
