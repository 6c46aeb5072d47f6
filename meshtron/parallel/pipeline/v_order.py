"""zb-v's order: list scheduling of each stage's ``F``, ``B`` and ``W`` on the chunks' costs.

In the V, stage ``s`` runs virtual stages ``s`` (chunk 0) and ``2 pp - 1 - s`` (chunk 1). This
module decides only the order of each stage's compute steps and how long that order takes when
the steps of virtual stage ``k`` cost ``costs[k]``: one figure for each of ``F``, ``B`` and
``W`` alike (the plan's FLOPs), or an ``(F, B, W)`` triple (the cost model's); the schedules module
turns the steps into actions and adds the communication. It depends on nothing else in the
package, so the partition can time a split with it.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import deque
from collections.abc import Sequence

Step = tuple[str, int, int]
"""(kind, micro-batch, chunk) of one compute step."""
Cost = float | tuple[float, float, float]
"""What a virtual stage's steps cost: F, B and W alike, or (F, B, W)."""

WORTH_ONE_MORE = 0.01
"""Admitting one more micro-batch than pp must shorten the step by this fraction: it keeps one
more first-chunk activation alive on every stage, so it is bought only for a real gain."""


def v_virtual(pp: int, stage: int, chunk: int) -> int:
    """The virtual stage chunk ``chunk`` of ``stage`` runs in the V."""
    return stage if chunk == 0 else 2 * pp - 1 - stage


def v_place(pp: int, virtual: int) -> tuple[int, int]:
    """The (stage, chunk) that runs ``virtual`` in the V (inverse of :func:`v_virtual`)."""
    return (virtual, 0) if virtual < pp else (2 * pp - 1 - virtual, 1)


def _input(kind: str, m: int, virtual: int, last: int) -> tuple[str, int, int] | None:
    """The step whose end a step waits for (kind, micro-batch, virtual stage), if any."""
    if kind == "F":
        return ("F", m, virtual - 1) if virtual else None
    if kind == "B":
        return ("F", m, virtual) if virtual == last else ("B", m, virtual + 1)
    return "B", m, virtual


def per_kind(costs: Sequence[Cost] | None, pp: int) -> list[dict[str, float]]:
    """Each virtual stage's cost of an ``F``, a ``B`` and a ``W`` (None: 1 each)."""
    if costs is None:
        return [dict.fromkeys("FBW", 1.0) for _ in range(2 * pp)]
    return [dict(zip("FBW", c)) if isinstance(c, tuple) else dict.fromkeys("FBW", c)
            for c in costs]


def list_schedule(pp: int, microbatches: int, costs: Sequence[Cost] | None = None,
                  admitted: int | None = None) -> tuple[list[list[Step]], float]:
    """Each stage's steps and the makespan of list scheduling them (Qi et al.'s ZB-V, built
    for the costs at hand rather than from a fixed pattern).

    Whenever a stage is free it runs, of the steps whose input is ready, a backward, else a
    forward, else its oldest deferred ``W``; among backwards or forwards the oldest
    micro-batch, the later virtual stage first. A stage starts a new micro-batch (its first
    chunk's forward) only while fewer than ``admitted`` (default pp) of its micro-batches
    await their first chunk's ``W``: with pp, at most 2 pp chunk activations, 1F1B's bound.
    With unit costs and m a multiple of pp the makespan is then 6m + pp - 1.
    """
    last, total = 2 * pp - 1, 6 * microbatches
    cost = per_kind(costs, pp)
    limit = admitted or pp
    # the end of each (virtual stage, micro-batch)'s F and B; inf until it is scheduled
    f_end = [[math.inf] * microbatches for _ in range(2 * pp)]
    b_end = [[math.inf] * microbatches for _ in range(2 * pp)]
    orders: list[list[Step]] = [[] for _ in range(pp)]
    next_f, next_b = [[0, 0] for _ in range(pp)], [[0, 0] for _ in range(pp)]
    weights: list[deque[Step]] = [deque() for _ in range(pp)]
    started = [0] * pp  # micro-batches whose first chunk's W has not run
    free = [0.0] * pp

    def pick(s: int, time: float) -> Step | None:
        # of two ready options the older micro-batch, on a tie chunk 1 (the later virtual stage)
        first, second = s, last - s
        m0, m1 = next_b[s]
        ready0 = m0 < microbatches and b_end[first + 1][m0] <= time
        # at the V's tip (stage 0's chunk 1) a backward follows its own forward
        after = f_end[second] if second == last else b_end[second + 1]
        ready1 = m1 < microbatches and after[m1] <= time
        if ready0 or ready1:
            return ("B", m1, 1) if ready1 and not (ready0 and m0 < m1) else ("B", m0, 0)
        m0, m1 = next_f[s]
        ready0 = m0 < microbatches and started[s] < limit and (
            first == 0 or f_end[first - 1][m0] <= time)
        ready1 = m1 < microbatches and f_end[second - 1][m1] <= time
        if ready0 or ready1:
            return ("F", m1, 1) if ready1 and not (ready0 and m0 < m1) else ("F", m0, 0)
        return weights[s].popleft() if weights[s] else None

    # (time, stage): a step ended at that time, on the stage or feeding one of its inputs; only
    # then can what the stage may run change (its W, its admissions and its inputs)
    events = [(0.0, s) for s in range(pp)]
    while events:
        time, s = heapq.heappop(events)
        if free[s] > time or len(orders[s]) == total:
            continue
        step = pick(s, time)
        if step is None:
            continue
        kind, m, chunk = step
        virtual = v_virtual(pp, s, chunk)
        free[s] = end = time + cost[virtual][kind]
        heapq.heappush(events, (end, s))
        if kind == "W":
            started[s] -= chunk == 0
        else:
            if kind == "F":
                next_f[s][chunk] += 1
                started[s] += chunk == 0
                f_end[virtual][m], fed = end, virtual + 1
            else:
                next_b[s][chunk] += 1
                weights[s].append(("W", m, chunk))
                b_end[virtual][m], fed = end, virtual - 1
            if 0 <= fed <= last:
                heapq.heappush(events, (end, v_place(pp, fed)[0]))
        orders[s].append(step)
    assert all(len(order) == total for order in orders), "zb-v ordering left steps out"
    return orders, max(free)


def replay(pp: int, orders: Sequence[Sequence[Step]], costs: Sequence[Cost]) -> float:
    """The makespan of given orders on ``costs``: each step starts once its stage is free and
    its input is ready."""
    last, cost = 2 * pp - 1, per_kind(costs, pp)
    ends: dict[tuple[str, int, int], float] = {}
    clock, done = [0.0] * pp, [0] * pp
    while any(done[s] < len(order) for s, order in enumerate(orders)):
        progressed = False
        for s, order in enumerate(orders):
            while done[s] < len(order):
                kind, m, chunk = order[done[s]]
                virtual = v_virtual(pp, s, chunk)
                needed = _input(kind, m, virtual, last)
                if needed is not None and needed not in ends:
                    break
                start = max(clock[s], ends[needed] if needed else 0.0)
                clock[s] = ends[kind, m, virtual] = start + cost[virtual][kind]
                done[s] += 1
                progressed = True
        assert progressed, "zb-v order deadlocks"
    return max(clock)


@functools.lru_cache(maxsize=64)
def _equal_chunks_order(pp: int, microbatches: int, admitted: int) -> tuple[tuple[Step, ...], ...]:
    """The list schedule for equal chunks, kept: every split and layout of one pipeline shape
    that the partition and the tuner time compares its own order with this one."""
    orders, _ = list_schedule(pp, microbatches, None, admitted)
    return tuple(tuple(order) for order in orders)


def fitted_order(pp: int, microbatches: int,
                 costs: Sequence[Cost]) -> tuple[list[list[Step]], float]:
    """The shortest, timed on ``costs``, of four list-scheduled orders: made for the costs or
    for equal chunks (greedy choices on unequal costs can lose to the regular pattern), with pp
    micro-batches admitted, or pp + 1 where that is :data:`WORTH_ONE_MORE` shorter. With a
    light first chunk and a heavy last one (the head) the first chunks' forwards cannot cover
    the trip round the V under pp, and every stage waits once a round; one more fills it."""
    def best(admitted: int) -> tuple[list[list[Step]], float]:
        own = list_schedule(pp, microbatches, costs, admitted)
        regular = _equal_chunks_order(pp, microbatches, admitted)
        timed = replay(pp, regular, costs)
        return ([list(order) for order in regular], timed) if timed < own[1] else own

    tight, loose = best(pp), best(pp + 1)
    return loose if loose[1] < tight[1] * (1 - WORTH_ONE_MORE) else tight
