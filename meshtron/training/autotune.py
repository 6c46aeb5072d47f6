"""Online re-tuning (``train.autotune``): the running job checks its pace against the cost
model and re-tunes, at a step boundary, what can change without changing the numbers.

Every ``train.autotune_every`` steps each rank's mean step time, mean compute time and peak
memory over the window are gathered (one all-gather of three numbers per rank). Every rank
then runs the same pure :class:`Retuner` on the same numbers, so all of them reach the same
decision with no further message.

The yardstick is the ratio of the measured step time to the cost model's prediction for the
running plan (``predict``, priced on ``train.autotune_profile``), taken at the first window:
a cost model is rarely exact on a given machine, but a *change* of that ratio means the
machine changed. Without a profile the ratio is the measured time itself. When the ratio
grows beyond ``train.autotune_drift`` for two windows in a row (sustained, not one noisy
window), the retuner names what it sees, in this order: a slow rank (its compute above
``run.straggler_factor`` times the others' median), memory pressure (the peak above 90% of
the device), exposed communication (the share of the step spent outside compute grew), or a
step slower than predicted. With ``knobs`` it then tries the other micro-batch sizes that keep
the global batch (those the plan accepts; the cost model's order first, smaller ones only
under memory pressure), one window each, and keeps the fastest measured. The global batch,
the data order and the learning-rate schedule are untouched, so the loss curve is the
unchanged run's up to the order of the gradient sums.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshtron.config import Config
from meshtron.errors import MeshtronError
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.plan import RunPlan, plan_run

Predict = Callable[[Config], float]
"""The cost model's step time, in seconds, of a config run on the job's ranks."""
SUSTAINED = 2
"""Windows in a row beyond the drift before the retuner acts."""
MEMORY_PRESSURE = 0.9
"""A peak above this share of the device's memory is memory pressure."""


@dataclass(frozen=True)
class Window:
    """What every rank measured over one window of steps."""

    step: int
    """The window's last step."""
    step_s: tuple[float, ...]
    """Each rank's mean step time."""
    compute_s: tuple[float, ...]
    """Each rank's mean compute time (forward and backward up to the gradient wait)."""
    memory_bytes: int
    """The largest peak memory of any rank."""

    @property
    def pace_s(self) -> float:
        """The job's step time: the slowest rank's (a synchronous job goes at its pace)."""
        return max(self.step_s)

    @property
    def outside_compute(self) -> float:
        """The median rank's share of the step spent waiting (communication, idle)."""
        return statistics.median(max(0.0, 1 - c / s) if s > 0 else 0.0
                                 for s, c in zip(self.step_s, self.compute_s))


def slow_rank(compute_s: tuple[float, ...], factor: float) -> int | None:
    """The rank whose compute exceeds ``factor`` times the other ranks' median (the slowest
    such rank), or None."""
    worst, worst_ratio = None, factor
    for rank, t in enumerate(compute_s):
        others = compute_s[:rank] + compute_s[rank + 1:]
        median = statistics.median(others) if others else 0.0
        if median > 0 and t / median > worst_ratio:
            worst, worst_ratio = rank, t / median
    return worst


@dataclass
class Retuner:
    """The decisions of online re-tuning, a pure function of the windows it is shown."""

    mode: str
    micro_batch: int
    options: list[int]
    """Micro-batch sizes the plan accepts at the running layout and global batch."""
    predict: Callable[[int], float] | None
    """The predicted step time of a micro-batch size, or None (measure only)."""
    drift: float
    straggler_factor: float
    memory_limit: float | None = None
    reference: float | None = None
    """The measured/predicted ratio the job is held to."""
    reference_wait: float = 0.0
    strikes: int = 0
    trying: list[int] = field(default_factory=list)
    measured: dict[int, float] = field(default_factory=dict)

    def ratio(self, w: Window, micro_batch: int) -> float:
        return w.pace_s / self.predict(micro_batch) if self.predict else w.pace_s

    def prediction(self, micro_batch: int) -> float | None:
        return self.predict(micro_batch) if self.predict else None

    def window(self, w: Window) -> list[dict]:
        """Take one window; returns the events to log (``{"event": "retune", ...}``) and may
        set :attr:`micro_batch`, which applies from the next step."""
        if self.trying or self.measured:
            return self._next_trial(w)
        ratio = self.ratio(w, self.micro_batch)
        if self.reference is None:
            self.reference, self.reference_wait = ratio, w.outside_compute
            return []
        if ratio <= self.reference * (1 + self.drift):
            self.strikes = 0
            return []
        self.strikes += 1
        if self.strikes < SUSTAINED:
            return []
        self.strikes = 0
        cause, rank = self._cause(w)
        event = self._event(w, cause=cause, rank=rank,
                            expected_step_s=self.reference * (self.prediction(self.micro_batch)
                                                              or 1.0))
        candidates = self._candidates(cause)
        if self.mode != "knobs" or not candidates:
            event["action"] = "none" if self.mode != "knobs" else "none: no other micro-batch"
            self.reference, self.reference_wait = ratio, w.outside_compute  # the new normal
            return [event]
        self.measured = {self.micro_batch: w.pace_s}
        self.trying = candidates
        self.micro_batch = self.trying.pop(0)
        event["action"] = f"try micro_batch {self.micro_batch}"
        return [event]

    def _next_trial(self, w: Window) -> list[dict]:
        self.measured[self.micro_batch] = w.pace_s
        if self.trying:  # the event is the measured window's; the action names the next
            event = self._event(w, action=f"try micro_batch {self.trying[0]}")
            self.micro_batch = self.trying.pop(0)
            return [event]
        best = min(self.measured, key=self.measured.__getitem__)
        event = self._event(w, action=f"keep micro_batch {best}",
                            measured={str(k): v for k, v in sorted(self.measured.items())})
        self.micro_batch, self.measured = best, {}
        self.reference = None  # the next window sets the yardstick of the chosen setting
        return [event]

    def _cause(self, w: Window) -> tuple[str, int | None]:
        rank = slow_rank(w.compute_s, self.straggler_factor)
        if rank is not None:
            return f"slow rank {rank}", rank
        if self.memory_limit and w.memory_bytes > MEMORY_PRESSURE * self.memory_limit:
            return "memory pressure", None
        if w.outside_compute > self.reference_wait + self.drift / (1 + self.drift):
            return "exposed communication", None
        return "slower than predicted", None

    def _candidates(self, cause: str) -> list[int]:
        others = [m for m in self.options if m != self.micro_batch]
        if cause == "memory pressure":
            others = [m for m in others if m < self.micro_batch]
        if self.predict:
            return sorted(others, key=self.predict)
        return sorted(others, key=lambda m: (abs(m - self.micro_batch), -m))

    def _event(self, w: Window, **fields: object) -> dict:
        predicted = self.prediction(self.micro_batch)
        row = {"event": "retune", "step": w.step, "micro_batch": self.micro_batch,
               "measured_step_s": w.pace_s, "outside_compute": w.outside_compute,
               "memory_bytes": w.memory_bytes}
        if predicted is not None:
            row["predicted_step_s"] = predicted
        return {**row, **fields}


def describe(event: dict) -> str:
    """The console line of a retune event."""
    parts = [f"retune at step {event['step']}:"]
    if "cause" in event:
        parts.append(f"{event['cause']}, measured {event['measured_step_s']:.3f} s per step "
                     f"vs {event['expected_step_s']:.3f} s expected;")
    elif "measured" in event:
        parts.append("measured " + ", ".join(f"micro_batch {k}: {v:.3f} s"
                                             for k, v in event["measured"].items()) + ";")
    else:
        parts.append(f"micro_batch {event['micro_batch']} measured "
                     f"{event['measured_step_s']:.3f} s per step;")
    parts.append(event["action"])
    return " ".join(parts)


def micro_batch_options(cfg: Config, world_size: int) -> dict[int, RunPlan]:
    """The plans of every micro-batch size that keeps the global batch and that the plan
    accepts (a pipeline schedule may need a count of micro-batches), by size."""
    share = plan_run(cfg, world_size).dp_share
    plans = {}
    for size in (d for d in range(1, share + 1) if share % d == 0):
        try:
            plans[size] = plan_run(dataclasses.replace(
                cfg, train=dataclasses.replace(cfg.train, micro_batch=size)), world_size)
        except MeshtronError:
            continue
    return plans


class WindowGather:
    """Each rank's step and compute times over a window, gathered at its end."""

    def __init__(self, mesh: ParallelMesh, every: int, device: torch.device | None = None):
        self.mesh, self.every, self.device = mesh, every, device
        self.steps: list[tuple[float, float, int]] = []

    def add(self, step: int, step_s: float, compute_s: float, memory: int) -> Window | None:
        """Record a step; at the end of a window (the same step on every rank) return what
        every rank measured. The run's first step (compilation, allocator warm-up) is left
        out."""
        if step > 1:
            self.steps.append((step_s, compute_s, memory))
        if step % self.every or not self.steps:
            return None
        mine = torch.tensor([statistics.fmean(s for s, _, _ in self.steps),
                             statistics.fmean(c for _, c, _ in self.steps),
                             float(max(m for _, _, m in self.steps))], dtype=torch.float64,
                            device=self.device)
        self.steps.clear()
        world = self.mesh.layout.world_size
        if self.mesh.world.pg is None:
            rows = [mine.tolist()]
        else:
            gathered = torch.zeros(world * 3, dtype=torch.float64, device=self.device)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(gathered, mine, group=self.mesh.world.pg)  # uncounted: not model traffic
            rows = gathered.view(world, 3).tolist()
        return Window(step, tuple(r[0] for r in rows), tuple(r[1] for r in rows),
                      int(max(r[2] for r in rows)))


class OnlineTuner:
    """The trainer's side of re-tuning: the window gather, the retuner, and the plans of the
    micro-batch sizes it may switch to (:attr:`plan` is the one to run)."""

    def __init__(self, cfg: Config, mesh: ParallelMesh, micro_batch: int,
                 predict: Predict | None, device: torch.device | None = None):
        t = cfg.train
        self.plans = micro_batch_options(cfg, mesh.layout.world_size)
        prices: dict[int, float] = {}

        def price(size: int) -> float:
            if size not in prices:
                prices[size] = predict(self.plans[size].config)
            return prices[size]

        limit = (torch.cuda.get_device_properties(device).total_memory
                 if device is not None and device.type == "cuda" else None)
        self.retuner = Retuner(t.autotune, micro_batch, sorted(self.plans),
                               price if predict else None, t.autotune_drift,
                               cfg.run.straggler_factor, limit)
        self.gather = WindowGather(mesh, t.autotune_every, device)

    def after_step(self, step: int, step_s: float, compute_s: float, memory: int) -> list[dict]:
        """Every rank after every step: the events of a window's end (the same on every rank)."""
        window = self.gather.add(step, step_s, compute_s, memory)
        return self.retuner.window(window) if window is not None else []

    @property
    def plan(self) -> RunPlan:
        return self.plans[self.retuner.micro_batch]
