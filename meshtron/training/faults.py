"""Fault injection, a testing tool: faults caused for real inside a training run.

Set ``MESHTRON_FAULTS`` to ``;``-separated faults, each ``kind[:key=value...]``::

    kill:rank=1:step=5         rank 1 SIGKILLs itself as step 5 begins
    stall:rank=1:step=5        rank 1 SIGSTOPs itself (a hung process) as step 5 begins
    nan:step=3                 step 3's loss is NaN on every rank (or only on rank=R)
    slow:rank=1:seconds=0.2    rank 1 computes 0.2 s longer every step (or only at step=S,
                               or from step F on with from=F)
    save:rank=0:step=4         rank 0 SIGKILLs itself inside the save of step 4, its shard
                               written, the checkpoint not yet complete

A fault without ``rank`` applies to every rank; without ``step`` (slow only), to every step.
The training step knows nothing of faults: :meth:`FaultPlan.injected` wraps the parts of the
rank it runs with, the loss (a ``nan`` step's first micro-batch loss is NaN) and the optimizer
(a ``slow`` rank's last micro-batch ends later: inside the step's compute time, after its
gradient reduction was waited for, so the other ranks do not wait for it there).
``kill``, ``stall`` and ``save`` fire only in the first attempt of an elastic run (a restarted group
would otherwise meet them again at the same step). Faults are read once, when the trainer
starts; an unknown kind or key is refused with one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtron.errors import MeshtronError
from meshtron.optim.data_parallel import DataParallelOptimizer
from meshtron.parallel.mesh.process import ATTEMPT_ENV, restart_count
from meshtron.rank import Rank

ENV = "MESHTRON_FAULTS"
KINDS = ("kill", "stall", "nan", "slow", "save")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    seconds: float = 0.0
    start: int | None = None
    """``from``: the first step of a fault that lasts (slow only)."""

    def applies(self, rank: int, step: int) -> bool:
        return self.rank in (None, rank) and self.step in (None, step) and (
            self.start is None or step >= self.start)


def parse_faults(text: str) -> list[Fault]:
    faults = []
    for spec in filter(None, (part.strip() for part in text.split(";"))):
        kind, *settings = spec.split(":")
        if kind not in KINDS:
            raise MeshtronError(f"{ENV}: unknown fault '{kind}' (one of {', '.join(KINDS)})")
        values: dict[str, float] = {}
        for setting in settings:
            key, _, value = setting.partition("=")
            if key not in ("rank", "step", "seconds", "from"):
                raise MeshtronError(f"{ENV}: unknown setting '{key}' in '{spec}'")
            try:
                values[key] = float(value)
            except ValueError:
                raise MeshtronError(f"{ENV}: '{setting}' in '{spec}' is not a number") from None
        if kind != "slow" and "step" not in values:
            raise MeshtronError(f"{ENV}: '{spec}' needs step=N")
        if "from" in values and kind != "slow":
            raise MeshtronError(f"{ENV}: from=N applies to slow faults only, not '{spec}'")
        faults.append(Fault(kind, _int(values.get("rank")), _int(values.get("step")),
                            values.get("seconds", 0.0), _int(values.get("from"))))
    return faults


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


class FaultPlan:
    """The faults of this rank, fired by the trainer at the start of each step."""

    def __init__(self, rank: int, env: dict[str, str] | None = None):
        env = dict(os.environ if env is None else env)
        self.rank = rank
        self.faults = parse_faults(env.get(ENV, ""))
        self.first_attempt = restart_count(env) == "0" and env.get(ATTEMPT_ENV, "0") == "0"

    def __bool__(self) -> bool:
        return bool(self.faults)

    def before_step(self, step: int) -> None:
        """Kill or stop this process (first attempt only). Before a kill, every rank meets at a
        barrier: what the previous step wrote (rank 0's metrics row) is then written before any
        rank dies, instead of racing the launcher's teardown."""
        if not self.first_attempt:
            return
        if any(f.kind == "kill" and f.step == step for f in self.faults) \
                and dist.is_available() and dist.is_initialized():
            dist.barrier()
        for fault in self.faults:
            if fault.kind in ("kill", "stall") and fault.applies(self.rank, step):
                os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)

    @contextlib.contextmanager
    def injected(self, step: int, rank: Rank) -> Iterator[Rank]:
        """Fire ``step``'s faults on this rank: a kill or stall now; the rank to train the step
        with, its optimizer slowed (``slow``) and its model's loss poisoned (``nan``) for the
        step. The loss is restored on leaving."""
        self.before_step(step)
        seconds = self.slow_seconds(step)
        if seconds > 0:
            rank = dataclasses.replace(rank, optimizer=_Slowed(rank.optimizer, seconds))
        if not self.poison_loss(step):
            yield rank
            return
        model = rank.model
        model.loss_sum = _poisoned(model.loss_sum)  # an instance attribute over the method
        try:
            yield rank
        finally:
            del model.loss_sum

    def in_save(self, step: int) -> None:
        """Called by the saver between this rank's shard and the checkpoint's completion."""
        if self.first_attempt and any(f.kind == "save" and f.applies(self.rank, step)
                                      for f in self.faults):
            os.kill(os.getpid(), signal.SIGKILL)

    def poison_loss(self, step: int) -> bool:
        return any(f.kind == "nan" and f.applies(self.rank, step) for f in self.faults)

    def slow_seconds(self, step: int) -> float:
        """Extra compute time of a straggler at ``step`` (spent inside the step's compute)."""
        return sum(f.seconds for f in self.faults if f.kind == "slow" and f.applies(self.rank,
                                                                                     step))


class _Slowed:
    """The rank's optimizer, whose step's last micro-batch ends ``seconds`` later (a
    straggler's compute); everything else is the optimizer's own."""

    def __init__(self, optimizer: DataParallelOptimizer, seconds: float):
        self._optimizer, self._seconds, self._last = optimizer, seconds, False

    def __getattr__(self, name: str):
        return getattr(self._optimizer, name)

    def begin_micro_batch(self, last: bool) -> None:
        self._last = last
        self._optimizer.begin_micro_batch(last=last)

    def end_micro_batch(self) -> None:
        self._optimizer.end_micro_batch()
        if self._last and self._seconds:
            time.sleep(self._seconds)
            self._seconds = 0.0


def _poisoned(loss_sum: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``loss_sum`` whose first result is NaN (this rank's first micro-batch of the step)."""
    calls = [0]

    def poisoned(*args, **kwargs) -> torch.Tensor:
        loss = loss_sum(*args, **kwargs)
        calls[0] += 1
        return loss * float("nan") if calls[0] == 1 else loss

    return poisoned
