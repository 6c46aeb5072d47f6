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

With ``layout`` the retuner also asks the cost model, at the first window, for the best layout
of the same ranks and batch; one predicted clearly faster (by more than the drift) is written
to ``RUN/autotune-layout.yaml`` after a checkpoint, with the running layout and its measured
step time, and the ranks exit with
:data:`~meshtron.parallel.mesh.launch.RELAYOUT_EXIT_CODE`: meshtron's launcher starts them
again, :func:`with_chosen_layout` gives every rank the new layout, and the resume reshards the
checkpoint and continues the same data order. The prediction is then checked: at the new
start's first window the new layout is kept if it measured no slower (within the drift) than
the old one, else the run moves back. Either way the layout is then settled for the run.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from meshtron.config import Config
from meshtron.costmodel.online import Overrides, running_prices
from meshtron.errors import MeshtronError
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.plan import RunPlan, plan_run

LAYOUT_FILE = "autotune-layout.yaml"
"""The layout ``train.autotune=layout`` chose, in the run directory, read by every restart."""


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
    propose: Callable[[], tuple[Overrides, float] | None] | None = None
    """``layout``: the cost model's best other layout and its predicted step time."""
    layout: Overrides = field(default_factory=dict)
    """The running layout's config fields (``layout``)."""
    history: dict | None = None
    """``layout``: what an earlier start of the run chose (:data:`LAYOUT_FILE`), if any."""
    restart: dict | None = None
    """What to write to :data:`LAYOUT_FILE` and restart into (``layout``, and ``previous``
    or ``settled``), once ``layout`` has decided."""
    settled: dict | None = None
    """What to write to :data:`LAYOUT_FILE` when a moved run keeps its new layout."""
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
            return self._relayout(w) if self.mode == "layout" else []
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
        if self.mode == "watch" or not candidates:
            event["action"] = "none" if self.mode == "watch" else "none: no other micro-batch"
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

    def _relayout(self, w: Window) -> list[dict]:
        """``layout`` at the first window. The first start: restart into the cost model's
        best layout when it is predicted faster than the running one by more than the drift.
        The start after such a move: keep the new layout if it measured no slower than the
        old one, else go back to it. Then the layout is settled."""
        history = self.history or {}
        if history.get("settled"):
            return []
        previous = history.get("previous")
        if previous is not None:
            before = float(previous["measured_step_s"])
            if w.pace_s <= before * (1 + self.drift):
                self.settled = {"layout": history["layout"], "settled": True}
                return [self._event(w, cause="the new layout measured", before_step_s=before,
                                    action="keep it")]
            self.restart = {"layout": previous["layout"], "settled": True}
            return [self._event(w, cause="the new layout measured slower", before_step_s=before,
                                action=f"restart into {layout_text(previous['layout'])}")]
        proposal = self.propose() if self.propose else None
        running = self.prediction(self.micro_batch)
        if proposal is None or running is None or proposal[1] * (1 + self.drift) >= running:
            return []
        layout, seconds = proposal
        self.restart = {"layout": layout, "previous": {
            "layout": self.running_layout(layout), "measured_step_s": w.pace_s}}
        return [self._event(w, cause="a faster layout", proposed_step_s=seconds, layout=layout,
                            action=f"restart into {layout_text(layout)}")]

    def running_layout(self, keys: Overrides) -> Overrides:
        """The running layout's values of the fields in ``keys`` (set by the tuner)."""
        return {k: self.layout.get(k) for k in keys}

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
    if "proposed_step_s" in event:
        parts.append(f"{event['cause']}, predicted {event['proposed_step_s']:.3g} s per step "
                     f"vs {event['predicted_step_s']:.3g} s for the running one;")
    elif "before_step_s" in event:
        parts.append(f"{event['cause']} {event['measured_step_s']:.3f} s per step vs "
                     f"{event['before_step_s']:.3f} s before the move;")
    elif "cause" in event:
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
        self.warm = False

    def add(self, step: int, step_s: float, compute_s: float, memory: int) -> Window | None:
        """Record a step; at the end of a window (the same step on every rank) return what
        every rank measured. The first step of this start (allocator and cache warm-up, ten
        times a later one) is left out."""
        if self.warm:
            self.steps.append((step_s, compute_s, memory))
        self.warm = True
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
                 device: torch.device | None = None):
        t = cfg.train
        cost = running_prices(cfg, mesh.layout.world_size)
        self.run_dir, self.writes = Path(cfg.run.dir), mesh.global_rank == 0
        self.plans = micro_batch_options(cfg, mesh.layout.world_size)
        prices: dict[int, float] = {}

        def price(size: int) -> float:
            if size not in prices:
                prices[size] = cost.step_time(self.plans[size].config)
            return prices[size]

        running = layout_fields(self.plans[micro_batch].config)

        def propose() -> tuple[Overrides, float] | None:
            return next(((o, s) for o, s in cost.layouts(cfg)
                         if {k: running.get(k) for k in o} != o), None)

        limit = (torch.cuda.get_device_properties(device).total_memory
                 if device is not None and device.type == "cuda" else None)
        self.retuner = Retuner(t.autotune, micro_batch, sorted(self.plans),
                               price if cost else None, t.autotune_drift,
                               cfg.run.straggler_factor, limit, propose if cost else None,
                               running, read_chosen_layout(Path(cfg.run.dir)))
        self.gather = WindowGather(mesh, t.autotune_every, device)

    def after_step(self, step: int, step_s: float, compute_s: float, memory: int) -> list[dict]:
        """Every rank after every step: the events of a window's end (the same on every rank)."""
        window = self.gather.add(step, step_s, compute_s, memory)
        events = self.retuner.window(window) if window is not None else []
        if self.retuner.settled is not None:  # kept after a move: no check at later starts
            if self.writes:
                write_chosen_layout(self.run_dir, step, self.retuner.settled)
            self.retuner.settled = None
        return events

    @property
    def plan(self) -> RunPlan:
        return self.plans[self.retuner.micro_batch]


def layout_fields(cfg: Config) -> Overrides:
    """The layout fields of a config, as the tuner's candidates name them."""
    fields = {f"parallel.{f.name}": getattr(cfg.parallel, f.name)
              for f in dataclasses.fields(cfg.parallel)}
    return {**fields, "train.micro_batch": cfg.train.micro_batch,
            "train.recompute": cfg.train.recompute}


def layout_text(layout: Overrides) -> str:
    return " ".join(f"{k.split('.', 1)[1]}={v}" for k, v in layout.items())


def write_chosen_layout(run_dir: Path, step: int, chosen: dict) -> Path:
    """Rank 0: the layout the next start runs (``chosen["layout"]``, read by
    :func:`with_chosen_layout`) and what the retuner must remember across the restart."""
    path = run_dir / LAYOUT_FILE
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"step": step, **chosen}, sort_keys=False))
    return path


def read_chosen_layout(run_dir: Path) -> dict | None:
    path = run_dir / LAYOUT_FILE
    if not path.is_file():
        return None
    try:
        chosen = yaml.safe_load(path.read_text())
        if not isinstance(chosen, dict) or not isinstance(chosen.get("layout"), dict):
            raise TypeError("no layout mapping")
    except (OSError, yaml.YAMLError, TypeError) as err:
        raise MeshtronError(f"{path} does not hold a layout ({type(err).__name__}: {err}); "
                            "delete it to run the configured layout") from None
    return chosen


def with_chosen_layout(cfg: Config) -> Config:
    """``cfg`` with the layout an earlier start of this run chose (``train.autotune=layout``),
    or ``cfg`` itself."""
    chosen = read_chosen_layout(Path(cfg.run.dir)) if cfg.train.autotune == "layout" else None
    if chosen is None:
        return cfg
    layout = chosen["layout"]
    parallel = {k.split(".", 1)[1]: v for k, v in layout.items() if k.startswith("parallel.")}
    train = {k.split(".", 1)[1]: v for k, v in layout.items() if k.startswith("train.")}
    try:
        return dataclasses.replace(
            cfg, parallel=dataclasses.replace(cfg.parallel, **{"pp_layers": None, **parallel}),
            train=dataclasses.replace(cfg.train, **train))
    except TypeError as err:  # a field that does not exist
        raise MeshtronError(f"{Path(cfg.run.dir) / LAYOUT_FILE} does not hold a layout "
                            f"({err}); delete it to run the configured layout") from None
