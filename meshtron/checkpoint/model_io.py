"""Whole-model access to checkpoints: the global weights in, a one-process checkpoint out.

For tools that work on a model as a whole (conversion to and from Hugging Face, inspection),
independent of the layout the checkpoint was saved under.
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshtron.checkpoint.store import open_checkpoint, save_tensors
from meshtron.config import Config, config_from_dict


def read_model_tensors(checkpoint: Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """The run config and every model parameter, whole, under its global name."""
    manifest, reader = open_checkpoint(checkpoint)
    cfg = config_from_dict(manifest["config"])
    names = [n for n in reader.tensors if n.startswith("model/")]
    return cfg, {n[len("model/"):]: reader.read(n) for n in names}


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
