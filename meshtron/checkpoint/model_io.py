"""Whole-model access to checkpoints: the global weights in, a one-process checkpoint out.

For tools that work on a model as a whole (conversion to and from Hugging Face, inspection,
generation), independent of the layout the checkpoint was saved under. What comes out is
checked: the config builds a model whose parameters the checkpoint holds with the same shapes
(compared on the meta device, before anything is allocated), and every weight is finite.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from meshtron.checkpoint.lora_merge import adapter_config, base_config, merged_model
from meshtron.checkpoint.manifest import read_manifest, saved_config
from meshtron.checkpoint.shards import check_finite
from meshtron.checkpoint.store import open_checkpoint, save_tensors
from meshtron.config import Config, config_from_dict
from meshtron.errors import MeshtronError
from meshtron.models.transformer import Transformer

LAYER_NAME = re.compile(r"^model/layers\.(\d+)\.")


def model_config(path: Path, manifest: dict[str, Any]) -> Config:
    """The checkpoint's run config, refused unless the model it builds is the one stored
    (an adapter checkpoint's: the merged model's, its adapters folded into the base)."""
    if "lora" in manifest:
        return base_config(adapter_config(path, manifest))
    try:
        cfg = config_from_dict(saved_config(path, manifest))
    except MeshtronError as err:
        raise MeshtronError(f"checkpoint {path} holds an invalid config: {err}") from None
    layers = {int(found.group(1)) for name in manifest["tensors"]
              if (found := LAYER_NAME.match(name))}
    m = cfg.model  # multi-token-prediction modules are layers after the decoder's
    if layers and len(layers) != m.num_layers + m.mtp_depth:  # before building (and timing)
        mtp = f" and model.mtp_depth={m.mtp_depth}" if m.mtp_depth else ""
        raise MeshtronError(f"checkpoint {path} holds {len(layers)} layers, its config says "
                            f"model.num_layers={m.num_layers}{mtp}")
    with torch.device("meta"):
        expected = {f"model/{name}": tuple(t.shape)
                    for name, t in Transformer(cfg.model).state_dict().items()}
    tensors = manifest["tensors"]
    for name, shape in expected.items():
        if name not in tensors:
            raise MeshtronError(f"checkpoint {path} lacks {name[6:]}, which its config's "
                                "model has")
        if tuple(tensors[name]["shape"]) != shape:
            raise MeshtronError(f"checkpoint {path}: {name[6:]} has shape "
                                f"{list(tensors[name]['shape'])}, its config implies "
                                f"{list(shape)}")
    return cfg


def read_model_tensors(checkpoint: Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """The run config and every model parameter, whole, under its global name (an adapter
    checkpoint's merged into its base)."""
    manifest = read_manifest(checkpoint)
    if "lora" in manifest:
        return merged_model(checkpoint, manifest)
    cfg = model_config(checkpoint, manifest)
    manifest, reader = open_checkpoint(checkpoint)
    names = [n for n in reader.tensors if n.startswith("model/")]
    tensors = {n[len("model/"):]: reader.read(n) for n in names}
    for name, tensor in tensors.items():
        check_finite(checkpoint, name, tensor)
    return cfg, tensors


def write_model_checkpoint(root: Path, cfg: Config, tensors: dict[str, torch.Tensor],
                           tokenizer: Path | None = None, step: int = 0) -> Path:
    """A checkpoint of the model weights only (no optimizer state), which training resumes
    from (``checkpoint.dir=root``) with fresh optimizer state, and ``meshtron generate`` runs."""
    copy = {"tokenizer.json": tokenizer} if tokenizer is not None else {}
    return save_tensors(
        root, step, {f"model/{name}": t for name, t in tensors.items()},
        meta={"config": cfg.to_dict(), "data": {"next_batch": step, "seed": cfg.train.seed}},
        copy_files=copy,
    )
