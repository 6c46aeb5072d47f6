"""``meshtron train``: the start-up checks, the run's lock, then the ranks (launched here with
``--nproc``, or this process being one of them) and the trainer.

Each check runs once per process, in the first process that sees the config, before any
process group or worker exists (:func:`preflight`): the layout (the plan's checks before the
tokenizer exists), the run and checkpoint directories, the training state's memory,
``train.autotune_profile``. That process is the ``--nproc`` launcher (which then starts the
ranks), a lone process, or, under plain torchrun, each rank (rank 0 alone says what failed).
A rank that meshtron's launcher started makes none of them here: its launcher made them on
the same config and world size, and the trainer checks the directory and the memory itself
(a restart's chosen layout included). The plan is built once per training process, by the
trainer, once the tokenizer gives the vocabulary."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import typing
from pathlib import Path

import torch

from meshtron.config import Config
from meshtron.costmodel.online import running_prices
from meshtron.errors import MeshtronError
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.parallel.mesh import launch as launcher
from meshtron.parallel.mesh.process import (
    LAUNCHER_ENV,
    ProcessInfo,
    device_for,
    die_with_launcher,
    init_process_group,
    process_info,
)
from meshtron.plan import check_run
from meshtron.training.autotune import with_chosen_layout
from meshtron.training.memory import check_state_fits
from meshtron.training.run_dir import check_run_dir
from meshtron.training.run_lock import run_lock

if typing.TYPE_CHECKING:
    from meshtron.training.trainer import TrainResult


def run_train(args: argparse.Namespace, extra: list[str], cfg: Config) -> int:
    """The command once its flags and config are read (:mod:`.train_arguments`)."""
    info = process_info()
    launching = (args.nproc > 1 or args.max_restarts > 0) and not info.distributed
    launched = bool(os.environ.get(LAUNCHER_ENV))  # a rank meshtron's launcher started
    cfg = with_chosen_layout(cfg)  # train.autotune=layout: what an earlier start chose
    if cfg.train.autotune == "layout" and not (launching or launched):
        raise MeshtronError("train.autotune=layout starts the ranks again in the new layout "
                            "through meshtron's launcher: run meshtron train --nproc N")
    if not launched:
        try:
            preflight(cfg, args.nproc if launching else info.world_size)
        except MeshtronError:
            if info.distributed and info.rank != 0:
                return 2  # every rank sees the same config and files: rank 0 says it once
            raise
    holder = not info.distributed or info.rank == 0  # the launcher, or rank 0 under torchrun
    with run_lock(Path(cfg.run.dir), cfg.checkpoint_dir) if holder else contextlib.nullcontext():
        if launching:
            forwarded = (["--config", args.config] if args.config else []) + extra
            return launcher.launch_local(args.nproc, forwarded, args.max_restarts,
                                         args.min_nproc, fits=lambda n: _layout_fits(cfg, n))
        return _train(cfg, info, checked=not launched)


def preflight(cfg: Config, world_size: int) -> None:
    """What the config asks for can work on ``world_size`` ranks here, or one line saying why
    not; before any process group, worker or tokenizer exists."""
    check_run(cfg, world_size)
    check_run_dir(cfg)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    check_state_fits(cfg, MeshLayout.of(cfg.parallel, world_size), device)
    running_prices(cfg, world_size)  # train.autotune_profile loads


def _layout_fits(cfg: Config, world_size: int) -> bool:
    """The plan accepts ``world_size`` ranks (a candidate for continuing on fewer)."""
    try:
        check_run(cfg, world_size)
    except MeshtronError:
        return False
    return True


def _train(cfg: Config, info: ProcessInfo, checked: bool) -> int:
    """This process's rank of the run; ``checked``: :func:`preflight` ran in this process."""
    from meshtron.training.trainer import train  # the launcher itself never trains

    die_with_launcher()
    init_process_group(info, cfg.run.timeout_s)
    mesh = ParallelMesh(MeshLayout.of(cfg.parallel, info.world_size), info.rank)
    result = train(cfg, mesh, device=device_for(info), checked=checked)
    if result.relayout is not None:  # train.autotune=layout: the launcher starts us again
        return launcher.RELAYOUT_EXIT_CODE
    if info.rank == 0:
        _summary(result)
    return 0


def _summary(result: TrainResult) -> None:
    """Rank 0's last lines: the losses, the checkpoint and where the run is."""
    if result.losses:
        summary = (f"trained steps {result.start_step}..{result.end_step}: loss "
                   f"{result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
        if result.val_loss is not None:
            summary += (f"; validation loss {result.val_loss:.4f}, perplexity "
                        f"{math.exp(result.val_loss):.2f}")
        print(summary)
    if result.checkpoint:
        print(f"checkpoint: {result.checkpoint}")
    print(f"run directory: {result.run_dir}")
