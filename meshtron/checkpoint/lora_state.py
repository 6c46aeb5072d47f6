"""An adapted model's checkpoints: the adapters and their optimizer state only, and which base
model they adapt, by digest.

A LoRA run (``model.lora.rank`` > 0) freezes every base parameter, so its checkpoints hold
only ``model/...lora.{a,b}`` and the adapters' AdamW state (:mod:`.held` leaves the frozen
parameters out). The manifest's ``lora`` entry names the base: ``path`` (the checkpoint the
base weights were read from, e.g. an imported model's ``step_00000000``; None: drawn from
``train.seed``) and ``digest`` (of that checkpoint's weight files, or of the seed and model
section). Resuming reads the base from ``path`` again and refuses, in one line, a base whose
digest is no longer the recorded one: adapters trained on one base mean nothing on another.
Pruning old checkpoints (``checkpoint.keep_last``) keeps the bases that kept ones adapt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshtron.checkpoint.held import Held
from meshtron.checkpoint.shards import ShardReader
from meshtron.checkpoint.store import open_checkpoint
from meshtron.errors import MeshtronError
from meshtron.parallel.mesh.params import global_names
from meshtron.parallel.tensor.lora import is_adapter, is_frozen_base

Log = Callable[[str], None]


def is_adapted(model: nn.Module) -> bool:
    return any(is_adapter(p) for p in model.parameters())


def weights_digest(manifest: dict[str, Any]) -> str:
    """The digest of a checkpoint's model weights: of the checksums of the files holding
    ``model/`` tensors (already recorded, so nothing is read)."""
    files = sorted({piece["file"] for name, entry in manifest["tensors"].items()
                    if name.startswith("model/") for piece in entry["pieces"]})
    text = json.dumps([(f, manifest["files"].get(f)) for f in files])
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def lora_meta(model: nn.Module) -> dict[str, Any]:
    """The manifest entry of an adapted model's checkpoint (empty for a whole model)."""
    base = getattr(model, "lora_base", None)
    return {"lora": base} if base is not None and is_adapted(model) else {}


def restore_base(path: Path, manifest: dict[str, Any], reader: ShardReader,
                 model: nn.Module, log: Log) -> bool:
    """Read an adapted model's frozen base. From an adapter checkpoint: the base it records,
    checked by digest (returns True: the adapters and their state are to be loaded from
    ``path``). From any other checkpoint (an imported model, a whole-model run): that
    checkpoint is the base, the adapters keep their initial values (returns False)."""
    record = manifest.get("lora")
    if record is None:
        load_frozen(path, reader, model)
        model.lora_base = {"path": str(path.resolve()), "digest": weights_digest(manifest)}
        log(f"adapters on the base model of {path}: base weights frozen, adapters start fresh")
        return False
    base_path = record.get("path")
    if base_path is None:
        found = model.lora_base["digest"]  # drawn from train.seed
    else:
        base = Path(base_path)
        if not (base / "meta.json").is_file():
            raise MeshtronError(f"checkpoint {path} adapts the base model at {base}, which is "
                                "gone; restore it there or train the adapters afresh")
        base_manifest, base_reader = open_checkpoint(base)
        found = weights_digest(base_manifest)
        if found == record["digest"]:
            load_frozen(base, base_reader, model)
    if found != record["digest"]:
        raise MeshtronError(f"checkpoint {path} holds adapters of base model "
                            f"{record['digest'][7:19]}, but this run's base is {found[7:19]} "
                            f"({base_path or 'drawn from train.seed'}); resume on the base "
                            "the adapters were trained on")
    model.lora_base = dict(record)
    return True


@torch.no_grad()
def load_frozen(path: Path, reader: ShardReader, model: nn.Module) -> None:
    """The frozen parameters of ``model`` (whole on every rank, but for their tp slice) from
    checkpoint ``path``, whatever layout wrote it."""
    names = global_names(model)
    for param in model.parameters():
        if not is_frozen_base(param):
            continue
        name = f"model/{names[id(param)]}"
        if not reader.has(name):
            raise MeshtronError(f"checkpoint {path} lacks {name[6:]} of the base model")
        held = Held(name, param, tuple(param.shape), param.data.view(-1), 0, False)
        if reader.shape(name) != held.global_shape:
            raise MeshtronError(f"checkpoint {path}: {name} has shape "
                                f"{list(reader.shape(name))}, the base model expects "
                                f"{list(held.global_shape)}")
        for local_box, global_box in held.boxes():
            reader.read_into(name, global_box, held.view(local_box))
    reader.verify()
