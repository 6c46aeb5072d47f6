"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr``.

A pure function of the step, so a resumed run needs no scheduler state to continue exactly.
"""

import math

from meshtron.config import TrainConfig


def learning_rate(step: int, t: TrainConfig) -> float:
    """The learning rate used by optimizer step ``step`` (0-based)."""
    if t.warmup_steps and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    decay_steps = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / decay_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))
