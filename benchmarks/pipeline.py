"""Pipeline parallelism (pp=2, pp=4, gloo, CPU): meshtron against ``torch.distributed.pipelining``.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline.py [--steps N] [--rounds R] [--json OUT]

(``--pp 2 4``, ``--warmup``, ``--configs NAME ...``, ``--timeout``: see ``--help``.)

**What runs.** Every configuration trains the same model, meshtron's ``Transformer`` of the
``tiny`` preset shape with ``--layers`` 8 layers (llama: hidden 256, 8 heads / 4 kv heads, ffn
768, vocab 4096, untied output; 8.4M parameters), seq 128, global batch 16 split into
micro-batches of 2 (M = 8), fp32, on ``pp`` spawned gloo processes (one per pipeline stage,
``MeshLayout(pp, tp=1, cp=1, pp=pp)``, no data parallelism) with one torch thread each. The
layers are split evenly, as torch's stages are (``parallel.pp_layers`` = L / (pp * vpp) per
virtual stage, through the run plan, ``plan_run``); virtual stage ``c * pp + s`` (chunk ``c``
of stage ``s``) holds the embedding when it is the first and the final norm, output layer and
loss when it is the last. Weights come
from meshtron's seeded ``initialize``, so every configuration starts from the same weights, and
step ``i`` trains on the same random global batch everywhere. AdamW with meshtron's parameter
groups and training defaults (lr 3e-3, betas 0.9/0.95, weight decay 0.1 on matrices) and
gradient clipping at 1.0 over the whole pipeline:

- ``meshtron <schedule>``: the plan's schedule (``build_schedule(schedule, pp, vpp, 8)``),
  ``PipelineExecutor``, ``build_optimizer(zero=0)`` (``torch.optim.AdamW(foreach=True)``) and
  ``train_step``
  (fp32 ``Precision``): loss sum / global tokens per micro-batch, backward, global grad norm
  (all-reduce over the model group), clip, update, loss all-reduced over pp.
- ``torch <schedule>``: ``torch.distributed.pipelining.PipelineStage`` around each of this
  rank's chunks of an identical meshtron ``Transformer`` (:class:`StageChunk`: the chunk's own
  layers as the stage module, ``forward`` = ``Transformer.forward(x, chunk=c)``), so the compute
  is the same and only scheduling and communication differ; ``loss_fn`` = token-CE sum / global
  tokens (``scale_grads=False``); ``build_adamw`` (``foreach=True``); grad norm = sqrt of the
  all-reduce (over pp) of each stage's squared ``get_total_norm``, ``clip_grads_with_norm_``;
  loss all-reduced over pp, as meshtron does.

``meshtron 1f1b balanced`` and ``meshtron zb-h1 balanced`` use meshtron's default split
instead (``plan_pipeline`` without ``pp_layers``: the balanced counts, with the embedding's
and the head's cost counted); ``meshtron <schedule> halves`` the half-layer split that
balances each part's cost as ``pipeline_bound.py`` measures it in the main process just before
(``parallel.pp_layers`` such as ``4.5,3.5``: a stage boundary between a layer's attention and
its MLP). ``meshtron zb-v`` runs zb-v (two chunks per stage in a V: stage 0 holds virtual
stages 0 and 3, so the embedding and the head) on the even split, ``meshtron zb-v halves`` on
the half-layer V split ``pipeline_bound.py`` balances (such as ``2.5,2.5,2,1``); both order
their actions by the chunks' FLOPs, as the plan does; ``meshtron zb-v halves measured``
re-orders after the warm-up for the F, B and W seconds measured in it, from step 2 on, in
every round (``parallel.zb_v_measured_order`` = ``--warmup``: ``MeasuredOrder``). The halves
configurations are unpaired, and the split of every meshtron configuration is printed.
Every ``meshtron <schedule>`` posts receives ahead by the schedule's default
(``receives_ahead_needed``: 1 for gpipe, 1f1b and zb-h1, 3 for interleaved at pp=2), so a
hand-over can happen while the stage computes; ``meshtron <schedule> late`` posts each receive
only right before its consumer (``receives_ahead=0``, as before 2026-12-05); also unpaired.
**Best vs best** sets the fastest meshtron configuration against the fastest torch one.

Pairs: meshtron ``gpipe`` / ``ScheduleGPipe``; ``1f1b`` / ``Schedule1F1B``; ``interleaved``
(vpp=2) / ``ScheduleInterleaved1F1B`` (two stages per rank); ``zb-h1`` /
``ScheduleInterleavedZeroBubble`` with one stage per rank (torch's ZB1P; it splits backward
into input and weight gradients itself); ``zb-v`` / ``ScheduleZBVZeroBubble`` (two stages per
rank in the same V, even split). The torch zero-bubble schedules are optional: if a round fails
with one, the round is rerun without them and the error is printed. The first step's loss
(initial weights, batch 0) and the last warm-up step's loss (after ``--warmup`` - 1 updates:
gradients, clipping and optimizer included) must agree across all configurations of a pp to
1e-4 relative (checked and printed).

**How it is timed.** For each pp, ``--rounds`` fresh process groups each build every
configuration, run ``--warmup`` steps of each, then ``--steps`` timed steps per configuration,
interleaved (every configuration takes one step in turn, the order rotating every step and
every round: ``benchmarks/harness``). Every rank waits at a barrier before each step; a step's
time is the slowest rank's wall time of the whole step (zero grad, the pipeline's forwards and
backwards, grad norm, clip, update, loss reduction). s/step = median over all timed steps of all
rounds; ratio = meshtron / torch of those medians; pair ratio = median over (round, step) of the
ratio of the two configurations' times in the same step.

**Idle time (meshtron only).** During every timed step ``PipelineExecutor.trace`` records the
``perf_counter`` start and end of each compute action (``F``, ``B``, ``W``; waiting for a
received input is not included). The step's pipeline span runs from the first action's start on
any stage to the last action's end on any stage (the span of the slowest stage: ``perf_counter``
is the system-wide monotonic clock, so the stages' times compare). Idle of stage s = 1 - (sum of
its action durations) / span; "measured" = the mean over stages, which is what
``schedule.bubble_fraction()`` computes for the simulated timeline; medians over the timed steps.
Beside it: ``schedule.theoretical_bubble()`` (closed form, unit costs F=1, B=2 or F=B=W=1,
equal stages), ``schedule.bubble_fraction()`` (its simulated timeline, unit costs), measured /
theory, the same timeline simulated with the measured costs (``pipeline_idle.py``: every
action takes its stage's median duration of that kind and chunk, communication is free), and
each step **replayed**: the timeline in which every action takes exactly the time it took in
that step (communication free); measured / replayed is the median over steps of their ratio. The
stages are not equally loaded even with equal layer counts (the last also runs the output layer
and the loss, the first the embedding), which the closed form ignores and the measured-cost
simulation includes; measured minus that simulation is what communication and waiting add.

With more processes than cores (pp=4 on 2 cores) the stages time-share cores, an action's
duration includes waiting for one, and the idle fractions (and pipelining's overlap) are
distorted; the script says so.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import harness
import pipeline_bound
import pipeline_idle
import pipeline_report
import torch
import torch.distributed as dist
from pipeline_shape import Shape
from torch import nn
from torch.distributed import pipelining

# meshtron: used in the "competitors" section, steps_task (the executors' trace) and bench_pp
# (the schedules handed to pipeline_idle) only
from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer
from meshtron.optim.adamw import build_adamw
from meshtron.optim.data_parallel import build_optimizer
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.parallel.pipeline.executor import PipelineExecutor
from meshtron.parallel.pipeline.measured_order import MeasuredOrder
from meshtron.parallel.pipeline.schedules import Schedule, build_schedule
from meshtron.plan import RunPlan, plan_run
from meshtron.rank import rank_with
from meshtron.training.step import train_step


@dataclass(frozen=True)
class Setup:
    name: str
    family: str
    """meshtron or torch."""
    schedule: str
    """A meshtron schedule name, or a ``torch.distributed.pipelining`` schedule class."""
    vpp: int
    optional: bool = False
    """Dropped (and the error reported) when a round fails with it."""
    split: str = "even"
    """meshtron's layer split: ``even`` (as torch's stages), ``balanced`` (its default, the
    head's cost counted) or ``halves`` (balanced to half layers by measured costs)."""
    ahead: int | None = None
    """meshtron: receives posted this many messages early (``build_schedule``; None: its
    default, ``receives_ahead_needed``)."""
    measured: bool = False
    """meshtron zb-v: re-ordered for the costs measured in the warm-up steps."""


SETUPS = {s.name: s for s in (
    Setup("meshtron gpipe", "meshtron", "gpipe", 1),
    Setup("torch GPipe", "torch", "ScheduleGPipe", 1),
    Setup("meshtron 1f1b", "meshtron", "1f1b", 1),
    Setup("torch 1F1B", "torch", "Schedule1F1B", 1),
    Setup("meshtron interleaved", "meshtron", "interleaved", 2),
    Setup("torch Interleaved1F1B", "torch", "ScheduleInterleaved1F1B", 2),
    Setup("meshtron zb-h1", "meshtron", "zb-h1", 1),
    Setup("torch InterleavedZB", "torch", "ScheduleInterleavedZeroBubble", 1, optional=True),
    Setup("meshtron 1f1b balanced", "meshtron", "1f1b", 1, split="balanced"),
    Setup("meshtron zb-h1 balanced", "meshtron", "zb-h1", 1, split="balanced"),
    Setup("meshtron 1f1b halves", "meshtron", "1f1b", 1, split="halves"),
    Setup("meshtron zb-h1 halves", "meshtron", "zb-h1", 1, split="halves"),
    Setup("meshtron zb-v", "meshtron", "zb-v", 2),
    Setup("torch ZBV", "torch", "ScheduleZBVZeroBubble", 2, optional=True),
    Setup("meshtron zb-v halves", "meshtron", "zb-v", 2, split="halves"),
    Setup("meshtron zb-v halves measured", "meshtron", "zb-v", 2, split="halves", measured=True),
    Setup("meshtron 1f1b late", "meshtron", "1f1b", 1, ahead=0),
    Setup("meshtron interleaved late", "meshtron", "interleaved", 2, ahead=0),
    Setup("meshtron zb-h1 late", "meshtron", "zb-h1", 1, ahead=0),
)}
PAIRS = [("meshtron gpipe", "torch GPipe"), ("meshtron 1f1b", "torch 1F1B"),
         ("meshtron interleaved", "torch Interleaved1F1B"),
         ("meshtron zb-h1", "torch InterleavedZB"), ("meshtron zb-v", "torch ZBV")]
TORCH_LAYOUTS = {"ScheduleInterleaved1F1B": "interleaved", "ScheduleZBVZeroBubble": "zb-v"}
"""The meshtron schedule whose chunk placement a torch schedule shares (else one chunk)."""


# ------------------------------------------------------------------------- the competitors


class StageChunk(nn.Module):
    """Chunk ``chunk`` of a stage-local meshtron ``Transformer`` as a torch pipelining stage
    module: it owns only that chunk's parameters and runs ``model.forward(x, chunk=chunk)``."""

    def __init__(self, model: Transformer, chunk: int):
        super().__init__()
        self.blocks = nn.ModuleList(model.layers[str(i)] for i in model.chunks[chunk])
        if model.has_embedding and chunk == 0:
            self.embed = model.embed
        if model.has_head and chunk == len(model.chunks) - 1:
            self.final_norm = model.final_norm
            self.output = model.output
        self._model = [model]  # a list: not registered, so not counted as this module's
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._model[0](x, chunk=self.chunk)


Halves = dict[int, list[float]]
"""Layers per virtual stage of the half-layer splits by vpp (1, or 2: zb-v's V)."""


def _plan(s: Shape, pp: int, vpp: int, schedule: str, split: str = "even",
          halves: Halves | None = None) -> RunPlan:
    """The run plan with an even layer split over ``pp * vpp`` virtual stages (as torch's
    stages are), meshtron's balanced default, or ``halves`` (layers per virtual stage)."""
    stages = pp * vpp
    counts = {"even": [s.layers // stages] * stages,
              "halves": halves[vpp] if halves else None}.get(split)
    layers = [f"--parallel.pp_layers={','.join(f'{c:g}' for c in counts)}"] if counts else []
    return plan_run(s.config(f"--parallel.pp={pp}", f"--parallel.vpp={vpp}",
                             f"--parallel.schedule={schedule}", *layers), pp)


def _stages(s: Shape, mesh: ParallelMesh, vpp: int, schedule: str, split: str = "even",
            halves: Halves | None = None, ours: bool = True) -> tuple[RunPlan, Transformer]:
    """The plan (see :func:`_plan`) and this rank's seeded model built from it (for torch,
    ``ours`` False, with weight gradients formed in the backward, as its stages expect)."""
    plan = _plan(s, mesh.pp.size, vpp, schedule, split, halves)
    cfg = plan.config
    options = plan.model_options(mesh.pp.rank)
    model = Transformer(plan.model, mesh,  # its own assembly: torch stages want ours=False
                        options if ours else replace(options, split_weight_grads=False))
    initialize(model, seed=cfg.train.seed, std=cfg.model.init_std, num_layers=cfg.model.num_layers)
    return plan, model.train()


Step = Callable[[torch.Tensor], float]


def build_meshtron(setup: Setup, s: Shape, mesh: ParallelMesh, halves: Halves | None,
                   warmup: int) -> tuple[Step, PipelineExecutor]:
    plan, model = _stages(s, mesh, setup.vpp, setup.schedule, setup.split, halves)
    cfg = plan.config
    schedule = _schedule(setup, s, mesh.pp.size, halves)
    executor = PipelineExecutor(model, mesh, plan.partition, schedule, cfg.model.hidden_size)
    optimizer = build_optimizer(model, mesh, cfg.train, zero=0, bucket_mb=25.0)
    parts = rank_with(plan, model, optimizer, mesh, pipeline=executor)  # the schedule under test
    reorder = MeasuredOrder(warmup, setup.ahead) if setup.measured else None

    def step(batch: torch.Tensor) -> float:
        loss = train_step(parts, batch, cfg.train.lr).loss
        if reorder is not None:
            reorder.after_step(executor, mesh)
        return loss

    return step, executor


def build_torch(setup: Setup, s: Shape, mesh: ParallelMesh) -> Step:
    plan, model = _stages(s, mesh, setup.vpp, TORCH_LAYOUTS.get(setup.schedule, "1f1b"),
                          ours=False)
    cfg, partition = plan.config, plan.partition
    count = partition.virtual_stages
    stages = [pipelining.PipelineStage(StageChunk(model, c),
                                       partition.virtual_stage(mesh.pp.rank, c),
                                       count, torch.device("cpu")) for c in range(setup.vpp)]
    global_tokens = s.global_batch * s.seq

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model.loss_sum(logits, targets) / global_tokens

    schedule_type = getattr(pipelining, setup.schedule)
    single = issubclass(schedule_type, pipelining.schedules.PipelineScheduleSingle)
    schedule = schedule_type(stages[0] if single else stages, s.microbatches, loss_fn=loss_fn,
                             scale_grads=False)
    first = any(st.stage_index == 0 for st in stages)
    last = any(st.stage_index == count - 1 for st in stages)
    optimizer = build_adamw(model, cfg.train)
    params = [p for p in model.parameters() if p.requires_grad]
    clip = cfg.train.grad_clip

    def step(batch: torch.Tensor) -> float:
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule.step(*([batch[:, :-1]] if first else []),
                      target=batch[:, 1:] if last else None, losses=losses if last else None)
        grads = [p.grad for p in params if p.grad is not None]
        norm_sq = torch.nn.utils.get_total_norm(grads, foreach=True) ** 2
        dist.all_reduce(norm_sq, group=mesh.pp.pg)
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm_sq.sqrt(), foreach=True)
        optimizer.step()
        loss = torch.stack(losses).detach().sum() if last else torch.zeros(())
        dist.all_reduce(loss, group=mesh.pp.pg)
        return float(loss)

    return step


def build_all(names: list[str], s: Shape, rank: int, pp: int, halves: Halves | None,
              warmup: int) -> tuple[dict[str, Step], dict[str, PipelineExecutor]]:
    """Every configuration of ``names`` on this rank (``MeshLayout(pp, tp=1, cp=1, pp=pp)``):
    its step, and for meshtron its executor, whose ``trace`` records the compute actions."""
    mesh = ParallelMesh(MeshLayout(pp, tp=1, cp=1, pp=pp), rank)
    steps: dict[str, Step] = {}
    executors: dict[str, PipelineExecutor] = {}
    for name in names:
        setup = SETUPS[name]
        if setup.family == "meshtron":
            steps[name], executors[name] = build_meshtron(setup, s, mesh, halves, warmup)
        else:
            steps[name] = build_torch(setup, s, mesh)
    return steps, executors


# ---------------------------------------------------------------------------------- worker


def steps_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Every configuration in this process group: warm-up, then timed steps interleaved with a
    rotating order; for meshtron, the trace summary of every timed step."""
    s = Shape(**args["shape"])
    names: list[str] = args["configs"]
    steps, executors = build_all(names, s, rank, dist.get_world_size(), args["halves"],
                                 args["warmup"])
    gen = torch.Generator().manual_seed(1000)
    batches = [torch.randint(0, s.vocab, (s.global_batch, s.seq + 1), generator=gen)
               for _ in range(args["warmup"] + args["steps"])]

    def step(name: str, i: int) -> harness.Timed[float]:
        return harness.timed(lambda: steps[name](batches[i]), barrier=dist.barrier)

    losses = {n: [step(n, i).value for i in range(args["warmup"])] for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    traces: dict[str, list[dict[str, Any]]] = {n: [] for n in executors}
    for i in range(args["steps"]):
        for name in harness.rotated(names, i + args["offset"]):
            if name in executors:
                executors[name].trace = []
            times[name].append(step(name, args["warmup"] + i).wall)
            if name in executors:
                traces[name].append(pipeline_idle.trace_summary(executors[name].trace or []))
                executors[name].trace = None
    return {"times": times, "traces": traces,
            "costs": {n: executor.schedule.costs for n, executor in executors.items()},
            "first_loss": {n: x[0] for n, x in losses.items()},
            "last_warmup_loss": {n: x[-1] for n, x in losses.items()}}


# ---------------------------------------------------------------------------------- report


def bench_pp(pp: int, args: Any, s: Shape) -> dict[str, Any]:
    """All rounds for one pipeline size; every figure of its tables."""
    names = [n for n in args.configs if not (SETUPS[n].vpp > 1 and s.layers % (pp * 2))]
    halves = None
    if any(SETUPS[n].split == "halves" for n in names):
        halves = pipeline_bound.half_layer_splits(s, pp)
    dropped: dict[str, str] = {}
    runs: list[list[dict[str, Any]]] = []
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        while True:
            task = {"shape": asdict(s), "configs": names, "warmup": args.warmup,
                    "steps": args.steps, "offset": r, "halves": halves}
            started = time.perf_counter()
            try:
                run = harness.spawn(steps_task, pp, task, timeout=args.timeout)
                break
            except RuntimeError as err:
                optional = [n for n in names if SETUPS[n].optional]
                if not optional:
                    raise
                for n in optional:
                    dropped[n] = str(err).strip().splitlines()[-1]
                    names.remove(n)
                print(f"  pp={pp} round {r + 1} failed with {', '.join(optional)}; rerun "
                      f"without: {dropped[optional[0]]}", flush=True)
        runs.append(run)
        print(f"  pp={pp} round {r + 1}/{args.rounds} ({time.perf_counter() - started:.0f} s, "
              f"load {os.getloadavg()[0]:.1f}): "
              + ", ".join(f"{n} {statistics.median(_slowest(run, n)):.3f}" for n in names),
              flush=True)
    load.append(os.getloadavg()[0])
    for key, what in (("first_loss", "first-step"), ("last_warmup_loss", "last warm-up step")):
        for run in runs:
            harness.check_close({n: run[0][key][n] for n in names}, f"pp={pp} {what} losses")
    times = {n: [_slowest(run, n) for run in runs] for n in names}
    rows = {n: {"s_per_step": statistics.median(itertools.chain(*times[n])),
                "round_medians": [statistics.median(t) for t in times[n]], "steps": times[n]}
            for n in names}
    pairs = [{"meshtron": ours, "torch": theirs,
              "ratio": rows[ours]["s_per_step"] / rows[theirs]["s_per_step"],
              "pair_ratio": harness.pair_ratio(itertools.chain(*times[ours]),
                                       itertools.chain(*times[theirs]))}
             for ours, theirs in PAIRS if ours in rows and theirs in rows]
    best = {family: min((n for n in names if SETUPS[n].family == family),
                        key=lambda n: rows[n]["s_per_step"], default=None)
            for family in ("meshtron", "torch")}
    if best["meshtron"] and best["torch"]:
        ours, theirs = best["meshtron"], best["torch"]
        best |= {"ratio": rows[ours]["s_per_step"] / rows[theirs]["s_per_step"],
                 "pair_ratio": harness.pair_ratio(itertools.chain(*times[ours]),
                                                  itertools.chain(*times[theirs]))}
    bubbles = {n: pipeline_idle.idle_figures(
        [_run_schedule(SETUPS[n], s, pp, run[0]["costs"][n]) for run in runs],
        [[rank["traces"][n] for rank in run] for run in runs])
        for n in names if SETUPS[n].family == "meshtron"}
    partitions = {n: _partition(SETUPS[n], s, pp, halves) for n in names
                  if SETUPS[n].family == "meshtron"}
    return {"pp": pp, "configs": rows, "pairs": pairs, "best": best, "bubbles": bubbles,
            "partitions": partitions, "dropped": dropped,
            "load_average": load, "first_loss": runs[0][0]["first_loss"],
            "last_warmup_loss": runs[0][0]["last_warmup_loss"]}


def _schedule(setup: Setup, s: Shape, pp: int, halves: Halves | None) -> Schedule:
    """A meshtron configuration's schedule: its plan's (zb-v's order made for the split's
    FLOPs), receives posted ``setup.ahead`` ahead."""
    planned = _plan(s, pp, setup.vpp, setup.schedule, setup.split, halves).schedule
    assert planned is not None
    return _run_schedule(setup, s, pp, planned.costs)


def _run_schedule(setup: Setup, s: Shape, pp: int, costs: Any) -> Schedule:
    """The schedule a meshtron configuration ran in one round: its plan's, or for ``measured``
    the order made for that round's measured costs (the same on every rank)."""
    return build_schedule(setup.schedule, pp, setup.vpp, s.microbatches,
                          receives_ahead=setup.ahead, costs=costs)


def _partition(setup: Setup, s: Shape, pp: int, halves: Halves | None) -> list[float]:
    """Layers per virtual stage of a meshtron configuration (the plan; no processes)."""
    partition = _plan(s, pp, setup.vpp, setup.schedule, setup.split, halves).partition
    return list(partition.counts)


def _slowest(run: list[dict[str, Any]], name: str) -> list[float]:
    return harness.across_ranks(rank["times"][name] for rank in run)


def main() -> None:
    cli = harness.cli
    parser = cli.parser(__doc__, cli.steps(6, "timed steps per configuration and round"),
                        cli.warmup(2, "warm-up steps (>= 2)"),
                        cli.rounds(2, "fresh process groups per pipeline size"),
                        cli.configs(list(SETUPS)), cli.timeout(900, "seconds per round"))
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes")
    parser.add_argument("--layers", type=int, default=Shape.layers,
                        help="transformer layers (divisible by 2 * pp for interleaved)")
    parser.add_argument("--seq", type=int, default=Shape.seq,
                        help="sequence length (the attention core, in F and B but not in W, "
                        "grows with it)")
    args = parser.parse_args()
    if args.warmup < 2:
        parser.error("--warmup must be at least 2 (the loss check compares two warm-up steps)")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers
    shape = Shape(layers=args.layers, seq=args.seq)
    info = harness.host_info()
    print(harness.host_line(info, "gloo, 1 thread per process"), flush=True)
    print(f"llama {shape.layers} x {shape.hidden} (ffn {shape.ffn}, vocab {shape.vocab}), seq "
          f"{shape.seq}, global batch {shape.global_batch} = {shape.microbatches} micro-batches "
          f"of {shape.micro_batch}, fp32 AdamW, clip 1.0; {args.rounds} rounds x "
          f"({args.warmup} warm-up + {args.steps} timed steps) per pp", flush=True)
    results = []
    for pp in args.pp:
        results.append(bench_pp(pp, args, shape))
        pipeline_report.print_pp(results[-1], args)
    end_load = os.getloadavg()
    print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in end_load)}")
    harness.write_json(args.json, harness.record(
        info, shape=asdict(shape), args=harness.plain_args(args), results=results,
        load_average_end=end_load))


if __name__ == "__main__":
    main()
