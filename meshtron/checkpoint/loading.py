"""Loading a trained model (and its tokenizer) from whatever path a user points at."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from meshtron.checkpoint.store import find_latest, read_manifest
from meshtron.checkpoint.train_state import load_weights
from meshtron.config import config_from_dict
from meshtron.data import Tokenizer
from meshtron.errors import MeshtronError
from meshtron.models.transformer import Transformer


def resolve_checkpoint(path: Path) -> Path:
    """A run directory, a checkpoint root or one checkpoint -> the newest complete checkpoint."""
    if not path.exists():
        raise MeshtronError(f"checkpoint path not found: {path}")
    root = path
    if (path / "config.yaml").is_file() and not (path / "meta.json").is_file():
        root = run_checkpoint_root(path, yaml.safe_load((path / "config.yaml").read_text()) or {})
    found = find_latest(root, warn=lambda m: print(f"warning: {m}"))
    if found is None:
        raise MeshtronError(f"no complete checkpoint under {root}")
    return found


def run_checkpoint_root(run_dir: Path, saved: dict) -> Path:
    """Where a run directory's checkpoints are. A relative ``checkpoint.dir`` was relative to
    the directory training ran in, which is ``run_dir`` minus the relative ``run.dir``."""
    configured = (saved.get("checkpoint") or {}).get("dir")
    if not configured:
        return run_dir / "checkpoints"
    root = Path(configured)
    if root.is_absolute() or root.exists():
        return root
    depth = len(Path((saved.get("run") or {}).get("dir", run_dir.name)).parts)
    return run_dir.resolve().parents[depth - 1] / root


def load_for_inference(path: Path, device: str = "cpu") -> tuple[Transformer, Tokenizer]:
    ckpt = resolve_checkpoint(path)
    cfg = config_from_dict(read_manifest(ckpt)["config"])
    model = Transformer(cfg.model)
    load_weights(ckpt, model)
    if not (ckpt / "tokenizer.json").is_file():
        raise MeshtronError(f"checkpoint {ckpt} has no tokenizer.json to turn text into tokens")
    tokenizer = Tokenizer.load(ckpt / "tokenizer.json")
    return model.to(torch.device(device)).eval(), tokenizer
