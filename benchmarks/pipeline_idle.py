"""The idle-time part of ``benchmarks/pipeline.py`` (its docstring says what is measured): each
stage's idle fraction from ``PipelineExecutor.trace``, against the schedule's closed form, its
timeline simulated with unit and with median measured costs, and each step replayed with every
action's own measured time.

It uses meshtron only through the objects it is given: a ``Schedule`` (``pp``,
``compute_actions``, ``dependencies``, ``theoretical_bubble``, ``bubble_fraction``,
``timeline``) and the trace's actions (``kind``, ``microbatch``, ``chunk``).
"""

from __future__ import annotations

import statistics
from typing import Any

from meshtron.parallel.pipeline.schedules import Schedule


def trace_summary(trace: list[tuple[Any, float, float]]) -> dict[str, Any]:
    """One stage's step: first start, last end, busy seconds, [seconds, count] per action
    kind and chunk (keys such as ``F0``, ``B1``, ``W0``), and every action's own seconds
    (``[kind, micro-batch, chunk, seconds]``, for the replay)."""
    kinds: dict[str, list[float]] = {}
    for action, start, end in trace:
        total = kinds.setdefault(f"{action.kind}{action.chunk}", [0.0, 0])
        total[0] += end - start
        total[1] += 1
    return {"start": min(t[1] for t in trace), "end": max(t[2] for t in trace),
            "busy": sum(t[2] - t[1] for t in trace), "kinds": kinds,
            "actions": [[a.kind, a.microbatch, a.chunk, end - start] for a, start, end in trace]}


def replayed_idle(schedule: Schedule, step: list[dict[str, Any]]) -> float:
    """Mean idle fraction of ``schedule``'s timeline when every action takes exactly the
    seconds it took in this measured step (free communication): what the schedule alone
    explains of the step's idle time, the variation between micro-batches included."""
    took = {(stage, kind, m, c): seconds for stage, t in enumerate(step)
            for kind, m, c, seconds in t["actions"]}
    rows = schedule.timeline(
        action_cost=lambda s, a: took[s, a.kind, a.microbatch, a.chunk])
    span = max(row[-1][1] for row in rows if row)
    return statistics.mean(1 - sum(end - start for start, end, _ in row) / span for row in rows)


def simulated_idle(schedule: Schedule, cost: dict[tuple[int, int, str], float]) -> list[float]:
    """Idle fraction of each stage in ``schedule``'s timeline when action (stage, chunk, kind)
    takes ``cost[stage, chunk, kind]`` and communication is free (as ``Schedule.timeline``)."""
    orders = [schedule.compute_actions(s) for s in range(schedule.pp)]
    ends: dict[tuple[int, Any], float] = {}
    clock, done = [0.0] * schedule.pp, [0] * schedule.pp
    progressed = True
    while progressed:
        progressed = False
        for s, order in enumerate(orders):
            while done[s] < len(order):
                action = order[done[s]]
                deps = schedule.dependencies(s, action)
                if any(d not in ends for d in deps):
                    break
                start = max([clock[s], *(ends[d] for d in deps)])
                clock[s] = ends[s, action] = start + cost[s, action.chunk, action.kind]
                done[s] += 1
                progressed = True
    span = max(clock)
    return [1 - sum(cost[s, a.chunk, a.kind] for a in order) / span
            for s, order in enumerate(orders)]


def idle_figures(schedules: list[Schedule], runs: list[list[list[dict[str, Any]]]]
                 ) -> dict[str, Any]:
    """Measured idle fractions (per stage and mean) against the schedule's theory, from the
    :func:`trace_summary` of every timed step of every rank of every run; ``schedules``: the
    one each run ran (they differ only where a run re-ordered zb-v for its measured costs)."""
    schedule = schedules[0]
    pp = schedule.pp
    per_stage: list[list[float]] = [[] for _ in range(pp)]
    means, spans, replays = [], [], []
    durations: dict[tuple[int, int, str], list[float]] = {}
    for ran, run in zip(schedules, runs):
        for step in zip(*run):
            span = max(t["end"] for t in step) - min(t["start"] for t in step)
            spans.append(span)
            idle = [1 - t["busy"] / span for t in step]
            for stage, value in enumerate(idle):
                per_stage[stage].append(value)
            means.append(statistics.mean(idle))
            replays.append(replayed_idle(ran, list(step)))
            for stage, t in enumerate(step):
                for key, (seconds, count) in t["kinds"].items():
                    durations.setdefault((stage, int(key[1:]), key[0]), []).append(
                        seconds / count)
    cost = {key: statistics.median(v) for key, v in durations.items()}
    simulated = [statistics.mean(stage) for stage in zip(*(simulated_idle(ran, cost)
                                                          for ran in schedules))]
    measured = statistics.median(means)
    theory = schedule.theoretical_bubble()
    per_kind = {kind: statistics.mean(v for (_, _, k), v in cost.items() if k == kind)
                for kind in sorted({k for _, _, k in cost}, key="FBW".index)}
    return {"idle_per_stage": [statistics.median(v) for v in per_stage],
            "idle": measured, "theory": theory, "simulated_unit": schedule.bubble_fraction(),
            "simulated_measured_costs": statistics.mean(simulated),
            "simulated_measured_costs_per_stage": simulated,
            "action_seconds": {f"{k}{c}@{st}": v for (st, c, k), v in cost.items()},
            "mean_action_seconds": per_kind, "span_s": statistics.median(spans),
            "replayed": statistics.median(replays),
            "measured_over_replayed": statistics.median(m / r for m, r in zip(means, replays)),
            "measured_over_theory": measured / theory}
