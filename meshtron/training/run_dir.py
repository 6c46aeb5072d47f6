"""What a run directory already holds, checked before a run writes into it.

A run directory remembers its run: ``config.yaml`` (written when a run starts) and the
checkpoints. A run of another model pointed at the same directory is refused up front, once,
before any process starts, rather than mixing its metrics, config and checkpoints into the
old run's. A resume from an earlier step than the newest sets the later checkpoints and metric
rows aside (renamed, never deleted), so the run has one history again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from meshtron.checkpoint.manifest import STEP_DIR, saved_config
from meshtron.checkpoint.store import step_dir_name
from meshtron.config import Config, config_from_dict
from meshtron.errors import MeshtronError
from meshtron.files import check_writable

MOE_SHAPE = ("num_experts", "expert_ffn_size", "shared_experts", "dense_layers", "every")
"""The MoE fields that shape parameters (routing settings may change between runs)."""


def model_differences(saved: dict[str, Any], cfg: Config) -> list[str]:
    """``"field: saved -> this run's"`` for each way ``cfg`` builds another model than the
    saved config (a resolved config.yaml or a checkpoint's). An unset ``model.vocab_size``
    comes from the tokenizer, so the tokenizer settings are compared in its place."""
    saved_model = saved.get("model") or {}
    current = cfg.to_dict()
    model = dict(current["model"])
    moe = model.pop("moe")
    model.pop("lora")  # adapters leave the base model as it is (their checkpoints say which)
    pairs = []
    for key, value in model.items():
        if key == "preset" or (key == "vocab_size" and value is None):
            continue
        if isinstance(value, dict):  # a nested section (rope, vision) field by field: a field
            # added since the saved config was written is not in it, and not a difference
            saved_section = saved_model.get(key) or {}
            pairs += [(f"model.{key}.{field}", saved_section.get(field), item)
                      for field, item in value.items()]
        else:
            pairs.append((f"model.{key}", saved_model.get(key), value))
    saved_moe = saved_model.get("moe") or {}
    pairs += [(f"model.moe.{key}", saved_moe.get(key), moe[key]) for key in MOE_SHAPE]
    saved_data = saved.get("data") or {}
    if cfg.model.vocab_size is None and "tokenizer" in saved_data:
        pairs.append(("data.tokenizer", saved_data.get("tokenizer"), cfg.data.tokenizer))
        if cfg.data.tokenizer is None and saved_data.get("tokenizer") is None:
            pairs.append(("data.vocab_size", saved_data.get("vocab_size"), cfg.data.vocab_size))
    return [f"{key}: {old} -> {new}" for key, old, new in pairs
            if old != new and (old is not None or key == "data.tokenizer")]


def check_run_dir(cfg: Config) -> None:
    """Refuse a run whose ``run.dir`` or ``checkpoint.dir`` cannot be written (probed: found
    at the first save, it would cost the steps before it), whose checkpoint directory holds a
    file named like a checkpoint, or whose run directory holds a run of another model."""
    run_dir = Path(cfg.run.dir)
    check_writable(run_dir, "run.dir")
    check_writable(cfg.checkpoint_dir, "checkpoint.dir")
    for entry in cfg.checkpoint_dir.iterdir() if cfg.checkpoint_dir.is_dir() else ():
        if STEP_DIR.match(entry.name) and not entry.is_dir():
            raise MeshtronError(f"{entry} is a file named like a checkpoint directory; move it "
                                "out of checkpoint.dir")
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        return
    try:
        saved = yaml.safe_load(saved_path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise MeshtronError(f"{saved_path} is unreadable ({type(err).__name__}); use another "
                            "run.dir or remove it") from None
    if not isinstance(saved, dict):
        raise MeshtronError(f"{saved_path} is not a run's config (a YAML mapping); use another "
                            "run.dir or remove it")
    differences = model_differences(saved, cfg)
    if differences:
        raise MeshtronError(
            f"{run_dir} holds a run of another model ({'; '.join(differences[:3])}); pass "
            "--run.dir=NEW_DIR for a new run, or the same settings to continue that one")


def check_resumable(cfg: Config, manifest: dict[str, Any], path: Path) -> None:
    """The checkpoint's config is a valid one, of a model with this run's shape."""
    saved = saved_config(path, manifest)
    try:
        config_from_dict(saved)
    except MeshtronError as err:
        raise MeshtronError(f"checkpoint {path} holds an invalid config: {err}") from None
    differences = model_differences(saved, cfg)
    if differences:
        raise MeshtronError(f"checkpoint {path} holds another model ({'; '.join(differences[:3])})"
                            "; use a new checkpoint.dir or the same model")


def resume_path(root: Path, resume_from: str) -> Path:
    """``checkpoint.resume_from``: a step number (its directory under ``root``) or a path."""
    path = root / step_dir_name(int(resume_from)) if resume_from.isdigit() else Path(resume_from)
    if not path.is_dir():
        raise MeshtronError(f"checkpoint.resume_from={resume_from}: no checkpoint at {path}")
    return path


def set_aside_later_checkpoints(root: Path, step: int) -> list[Path]:
    """Rename the checkpoints of steps after ``step`` to ``abandoned-step_*`` (so the newest
    checkpoint is again this run's); returns the new names."""
    moved = []
    for path in sorted(root.iterdir()):
        match = STEP_DIR.match(path.name)
        if match and int(match.group(1)) > step:
            target = root / f"abandoned-{path.name}"
            suffix = 1
            while target.exists():
                target, suffix = root / f"abandoned-{path.name}.{suffix}", suffix + 1
            os.replace(path, target)
            moved.append(target)
    return moved


def set_aside_later_metrics(run_dir: Path, step: int) -> int:
    """Move ``metrics.jsonl`` rows of steps after ``step`` (steps being trained again) to
    ``metrics.replaced.jsonl``, so the run's metrics hold one row per step; returns how many."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    kept, replaced = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            row_step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            continue  # a torn line from a crash
        (replaced if isinstance(row_step, int) and row_step > step else kept).append(line)
    if replaced:
        with open(run_dir / "metrics.replaced.jsonl", "a") as f:
            f.writelines(replaced)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return len(replaced)
