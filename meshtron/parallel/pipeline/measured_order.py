"""zb-v's order rebuilt for the chunks' measured costs (``parallel.zb_v_measured_order``).

The plan orders zb-v's steps for each chunk's FLOPs, pricing its ``F``, ``B`` and ``W`` alike.
Measured they differ: ``W`` has no attention core, normalisation or activation work
(``benchmarks/pipeline.py --seq 512`` on this CPU: 69, 97 and 44 ms a chunk), and on a GPU
``F`` and ``B`` carry the tp and ep communication that ``W`` does not. :class:`MeasuredOrder`
times every compute action for a few steps (``PipelineExecutor.trace``), gives every rank each
chunk's median ``F``, ``B`` and ``W`` seconds, and rebuilds the order from them
(:func:`.v_order.fitted_order`); the plan's order stays where, timed on the same figures, the
new one is not shorter.

Every rank must run the same order: pipeline peers match messages by it, and tp and dp peers
meet in the collectives inside its actions. So the figures are averaged over each stage's
replicas with one all-reduce over the world, and rank 0's result is broadcast: every rank
orders from the same bits. A chunk still runs its micro-batches' ``B`` and ``W`` in
micro-batch order, so a parameter's gradient adds its micro-batches in the order it did;
only a weight two chunks share (tied embeddings on zb-v's stage 0) may add them in another.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.pipeline.executor import PipelineExecutor
from meshtron.parallel.pipeline.schedules import Schedule, build_schedule
from meshtron.parallel.pipeline.v_order import replay, v_virtual

KINDS = "FBW"


class MeasuredOrder:
    """After ``after_steps`` steps of a zb-v executor (steps 2 on traced), its order made for
    the measured costs; ``receives_ahead`` as ``parallel.receives_ahead``."""

    def __init__(self, after_steps: int, receives_ahead: int | None):
        assert after_steps >= 2, "the first step (allocations, warm-up) is not timed"
        self.after_steps = after_steps
        self.receives_ahead = receives_ahead
        self.executor: PipelineExecutor | None = None
        self.steps = 0
        self.seconds: dict[tuple[int, str], list[float]] = {}

    def after_step(self, executor: PipelineExecutor, mesh: ParallelMesh) -> str | None:
        """Called after every training step: collects the step's trace and, after the last
        measured step, re-orders ``executor`` (:meth:`reorder`) and returns its line."""
        if executor is not self.executor:  # a new layout (train.autotune): measured afresh
            self.executor, self.steps, self.seconds = executor, 0, {}
        if not executor.schedule.vshape or self.steps >= self.after_steps:
            return None
        self.steps += 1
        for action, start, end in executor.trace or ():
            self.seconds.setdefault((action.chunk, action.kind), []).append(end - start)
        executor.trace = [] if self.steps < self.after_steps else None
        if self.steps < self.after_steps:
            return None
        device = next(executor.model.parameters()).device
        costs = shared_costs(self.seconds, executor.schedule, mesh, executor.stage, device)
        timed = f"{self.after_steps - 1} step{'s' * (self.after_steps > 2)}"
        return self.reorder(executor, costs,
                            f"the chunks' F, B and W seconds measured over {timed}")

    def reorder(self, executor: PipelineExecutor, costs: list[tuple[float, float, float]],
                what: str) -> str:
        """Put the order made for ``costs`` (the same on every rank) into ``executor``, unless
        the order it runs is as short on them; a line saying which (``what``: the costs)."""
        old = executor.schedule
        new = build_schedule(old.name, old.pp, old.vpp, old.microbatches,
                             receives_ahead=self.receives_ahead, costs=costs)
        before = replay(old.pp, _orders(old), costs)
        after = replay(new.pp, _orders(new), costs)
        if after >= before:
            return (f"pipeline: zb-v keeps its order: on {what} no order is shorter "
                    f"({before:.4g} s a step)")
        executor.use(new)
        return (f"pipeline: zb-v re-ordered for {what}; a step's pipeline simulated on them "
                f"takes {before:.4g} s in the plan's order, {after:.4g} s in the new one")


def shared_costs(seconds: dict[tuple[int, str], list[float]], schedule: Schedule,
                 mesh: ParallelMesh, stage: int, device: torch.device
                 ) -> list[tuple[float, float, float]]:
    """Each virtual stage's (F, B, W) seconds: this stage's medians, averaged over the ranks
    that run the same stage and broadcast from rank 0, so every rank holds the same figures."""
    pp = schedule.pp
    figures = torch.zeros(pp, 2, len(KINDS), dtype=torch.float64)
    for chunk in range(2):
        for k, kind in enumerate(KINDS):
            figures[stage, chunk, k] = statistics.median(seconds[chunk, kind])
    world = mesh.world
    if world.pg is not None:  # on the parameters' device, where NCCL wants it
        figures = figures.to(device)
        dist.all_reduce(figures, group=world.pg)
        figures /= world.size // pp  # the ranks of one stage: its tp, cp and dp replicas
        dist.broadcast(figures, src=world.ranks[0], group=world.pg)
    costs: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)] * (2 * pp)
    for s in range(pp):
        for chunk in range(2):
            f, b, w = figures[s, chunk].cpu().tolist()
            costs[v_virtual(pp, s, chunk)] = (f, b, w)
    return costs


def _orders(schedule: Schedule) -> list[list[tuple[str, int, int]]]:
    """Each stage's compute steps as :mod:`.v_order` writes them."""
    return [[(a.kind, a.microbatch, a.chunk) for a in schedule.compute_actions(s)]
            for s in range(schedule.pp)]
