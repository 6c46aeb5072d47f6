"""Resuming a run: the newest usable checkpoint (or ``checkpoint.resume_from``) read into this
rank's parts, whatever layout wrote it; what a resumed run would otherwise overwrite (later
checkpoints, later metric rows) is set aside by rank 0."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from meshtron.checkpoint import train_state
from meshtron.checkpoint.store import find_latest, open_checkpoint
from meshtron.config import Config
from meshtron.rank import Rank
from meshtron.training.finetune_start import finetune_report
from meshtron.training.run_dir import (
    check_resumable,
    resume_path,
    set_aside_later_checkpoints,
    set_aside_later_metrics,
)

Log = Callable[[str], None]


def resume(cfg: Config, rank: Rank, run_dir: Path, log: Log, warn: Log) -> int:
    """The step the run continues from (0: nothing to resume, ``checkpoint.resume`` off)."""
    c = cfg.checkpoint
    if not c.resume:
        return 0
    root = cfg.checkpoint_dir
    if c.resume_from is not None:
        path: Path | None = resume_path(root, c.resume_from)
    else:
        path = find_latest(root, warn=warn, on_corrupt=c.on_corrupt)
    if path is None:
        return 0
    manifest, reader = open_checkpoint(path)
    check_resumable(cfg, manifest, path)
    mesh = rank.mesh
    train_state.restore(path, manifest, reader, rank.model, rank.optimizer, mesh,
                        rank.precision.scaler, log)
    finetune_report(manifest, cfg.train, log, warn)
    step = int(manifest["step"])
    saved_layout = manifest.get("layout")
    moved = (f"; saved under {_layout_text(saved_layout)}, resharded to "
             f"{_layout_text(mesh.layout.sizes())}"
             if isinstance(saved_layout, dict) and saved_layout != mesh.layout.sizes()
             else "")
    log(f"resumed from {path} at step {step}{moved}")
    if mesh.world.pg is not None:
        torch.distributed.barrier()  # every rank has read it before anything is renamed
    if mesh.global_rank == 0:
        if root.is_dir():
            for aside in set_aside_later_checkpoints(root, step):
                log(f"set aside the later checkpoint as {aside}")
        replaced = set_aside_later_metrics(run_dir, step)
        if replaced:
            log(f"moved {replaced} metric rows of steps after {step} to "
                f"{run_dir / 'metrics.replaced.jsonl'}")
    return step


def _layout_text(sizes: dict) -> str:
    return " ".join(f"{axis}={size}" for axis, size in sizes.items())
