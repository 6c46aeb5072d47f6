"""Loading a trained model (and its tokenizer) from whatever path a user points at.

Everything read is checked before it is trusted: the manifest against its schema and the
shapes its config implies (on the meta device, so a config that asks for terabytes allocates
nothing), the tokenizer against its checksum, and the weights for NaN or infinity.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import yaml

from meshtron.checkpoint.manifest import read_manifest, verify_file
from meshtron.checkpoint.model_io import model_config
from meshtron.checkpoint.shards import check_finite
from meshtron.checkpoint.store import find_latest
from meshtron.checkpoint.train_state import load_weights
from meshtron.data import Tokenizer
from meshtron.errors import MeshtronError
from meshtron.models.transformer import Transformer

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


def load_for_inference(path: Path, device: str = "cpu") -> tuple[Transformer, Tokenizer]:
    ckpt = resolve_checkpoint(path)
    manifest = read_manifest(ckpt)
    cfg = model_config(ckpt, manifest)
    if "tokenizer.json" not in manifest["files"] and not (ckpt / "tokenizer.json").exists():
        raise MeshtronError(f"checkpoint {ckpt} has no tokenizer.json to turn text into tokens")
    tokenizer = Tokenizer.load(verify_file(ckpt, manifest, "tokenizer.json"))
    model = Transformer(cfg.model)
    load_weights(ckpt, model)
    for name, param in model.named_parameters():
        check_finite(ckpt, name, param)
    return model.to(torch.device(device)).eval(), tokenizer
