"""What a run says when it starts from pretrained weights (an imported, weights-only
checkpoint): the learning-rate schedule and weight decay it fine-tunes with.

The values are the run's own ``train.*`` settings: ``meshtron convert`` writes the fine-tuning
defaults of :mod:`meshtron.config.finetune` into the ``train.yaml`` it makes, and a user may
change them. A run that starts pretrained weights on the from-scratch schedule is warned, since
that schedule's peak on fresh optimizer moments undoes what the model knew.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshtron.config import TrainConfig
from meshtron.config.finetune import FINETUNE_TRAIN

Log = Callable[[str], None]


def schedule_text(t: TrainConfig) -> str:
    return (f"lr {t.lr:g} after a {t.warmup_steps}-step warm-up, cosine decay to {t.min_lr:g} "
            f"by step {t.steps}, weight decay {t.weight_decay:g}")


def finetune_report(manifest: dict[str, Any], t: TrainConfig, log: Log, warn: Log) -> None:
    """For a checkpoint of weights only (no optimizer state: an imported model), say the
    schedule this run continues it with, and warn when it is the from-scratch one."""
    if "optimizer" in manifest:  # a checkpoint training wrote: the run goes on as it was
        return
    ours = {key: getattr(t, key) for key in FINETUNE_TRAIN}
    if ours == FINETUNE_TRAIN:
        log(f"fine-tuning defaults: {schedule_text(t)} (the weights are pretrained; "
            "set train.lr, min_lr, warmup_steps, weight_decay to change them)")
        return
    scratch = {key: getattr(TrainConfig(), key) for key in FINETUNE_TRAIN}
    if ours == scratch:
        fix = " ".join(f"--train.{key}={value:g}" for key, value in FINETUNE_TRAIN.items())
        warn(f"pretrained weights with the from-scratch schedule ({schedule_text(t)}): its peak "
             f"on fresh optimizer moments undoes what the model learned; to fine-tune use {fix} "
             "(what the train.yaml of `meshtron convert` sets)")
        return
    log(f"fine-tuning settings: {schedule_text(t)} (the weights are pretrained)")
