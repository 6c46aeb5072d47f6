"""Loading a trained model (and its tokenizer) from whatever path a user points at, whole or
as one rank's part of a tp x pp replica (the resharding reader: each rank reads only its boxes).

Everything read is checked before it is trusted: the manifest against its schema and the
shapes its config implies (on the meta device, so a config that asks for terabytes allocates
nothing), the tokenizer against its checksum, and the weights for NaN or infinity.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from meshtron.checkpoint.lora_merge import load_merged
from meshtron.checkpoint.manifest import read_manifest, verify_file
from meshtron.checkpoint.model_io import model_config
from meshtron.checkpoint.shards import check_finite
from meshtron.checkpoint.store import find_latest
from meshtron.checkpoint.train_state import load_weights
from meshtron.config import Config
from meshtron.data import Tokenizer
from meshtron.errors import MeshtronError
from meshtron.models.transformer import WHOLE_MODEL, Transformer
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.plan import RunPlan
from meshtron.precision.policy import Precision

OLDER_CHECKPOINT_HINT = "point at an older step_* directory to use that one instead"


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def resolve_checkpoint(path: Path) -> Path:
    """A run directory, a checkpoint root or one checkpoint -> the newest checkpoint, which
    must be usable (see :func:`meshtron.checkpoint.store.find_latest`)."""
    if not path.exists():
        raise MeshtronError(f"checkpoint path not found: {path}")
    root = path
    if (path / "config.yaml").is_file() and not (path / "meta.json").is_file():
        try:
            saved = yaml.safe_load((path / "config.yaml").read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
            raise MeshtronError(f"{path / 'config.yaml'} is unreadable "
                                f"({type(err).__name__})") from None
        root = run_checkpoint_root(path, saved if isinstance(saved, dict) else {})
    found = find_latest(root, warn=warn, hint=OLDER_CHECKPOINT_HINT)
    if found is None:
        raise MeshtronError(f"no complete checkpoint under {root}")
    return found


def run_checkpoint_root(run_dir: Path, saved: dict) -> Path:
    """Where a run directory's checkpoints are. A relative ``checkpoint.dir`` was relative to
    the directory training ran in, which is ``run_dir`` minus the relative ``run.dir``."""
    checkpoint, run = saved.get("checkpoint"), saved.get("run")
    configured = checkpoint.get("dir") if isinstance(checkpoint, dict) else None
    if not configured or not isinstance(configured, str):
        return run_dir / "checkpoints"
    root = Path(configured)
    if root.is_absolute() or root.exists():
        return root
    relative = run.get("dir") if isinstance(run, dict) else None
    depth = len(Path(relative if isinstance(relative, str) else run_dir.name).parts)
    parents = run_dir.resolve().parents
    return (parents[depth - 1] if depth <= len(parents) else run_dir) / root


SAVED_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


@dataclass(frozen=True)
class InferenceCheckpoint:
    """A checkpoint opened for inference: checked, its model not yet built."""

    path: Path
    manifest: dict[str, Any]
    config: Config
    tokenizer: Tokenizer

    @property
    def saved_dtype(self) -> str:
        """The ``precision.dtype`` its weights were saved in (the most common among them): a
        bf16 run's or a bf16 Hugging Face model's checkpoint runs in bf16 by default."""
        counts = Counter(entry.get("dtype") for name, entry in self.manifest["tensors"].items()
                         if name.startswith("model/"))
        return SAVED_DTYPES.get(counts.most_common(1)[0][0] if counts else "", "fp32")


def open_for_inference(path: Path) -> InferenceCheckpoint:
    """The newest usable checkpoint under ``path``, its model config and its tokenizer."""
    ckpt = resolve_checkpoint(path)
    manifest = read_manifest(ckpt)
    cfg = model_config(ckpt, manifest)
    if "tokenizer.json" not in manifest["files"] and not (ckpt / "tokenizer.json").exists():
        raise MeshtronError(f"checkpoint {ckpt} has no tokenizer.json to turn text into tokens")
    tokenizer = Tokenizer.load(verify_file(ckpt, manifest, "tokenizer.json"))
    return InferenceCheckpoint(ckpt, manifest, cfg, tokenizer)


def load_model(ckpt: InferenceCheckpoint, plan: RunPlan | None = None,
               mesh: ParallelMesh | None = None, dtype: str | None = None,
               device: torch.device | str = "cpu") -> Transformer:
    """This rank's part of the model (``plan``'s stage on ``mesh``; default the whole model),
    its parameters in ``dtype`` (default: as saved), read straight from the checkpoint's boxes
    whatever layout wrote them."""
    mesh = mesh or ParallelMesh.single()
    cfg = plan.model if plan is not None else ckpt.config.model
    options = plan.model_options(mesh.pp.rank) if plan is not None else WHOLE_MODEL
    model = Transformer(cfg, mesh, options)
    Precision(dtype or ckpt.saved_dtype, torch.device(device)).cast_parameters(model)
    if "lora" in ckpt.manifest:  # adapters: merged into their base as it loads
        load_merged(ckpt.path, ckpt.manifest, model)
    else:
        load_weights(ckpt.path, model)
    for name, param in model.named_parameters():
        check_finite(ckpt.path, name, param)
    return model.to(torch.device(device)).eval()


def load_for_inference(path: Path, device: str = "cpu",
                       dtype: str | None = None) -> tuple[Transformer, Tokenizer]:
    """The whole model (in ``dtype``, default as saved) and its tokenizer."""
    ckpt = open_for_inference(path)
    return load_model(ckpt, dtype=dtype, device=device), ckpt.tokenizer
