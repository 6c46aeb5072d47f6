"""Pipeline schedules as data: the ordered actions of every stage, and their simulated timeline.

A generator only decides the order of the compute actions (``F``, ``B``, ``W``) on each stage;
one shared pass (:func:`add_communication`) then inserts the sends and the receive posts, so
every schedule obeys the same matching rule and one executor runs them all. The timeline
simulation turns an order into start and end times, from which the bubble fraction follows;
tests compare it with the closed-form theory of each schedule.

Virtual stages follow Megatron's interleaving: chunk ``c`` of stage ``s`` is virtual stage
``c * pp + s``; zb-v places its two chunks in a V instead (``s`` and ``2 * pp - 1 - s``, see
:mod:`.partition`). A forward flows from virtual stage ``k`` to ``k + 1``, a backward back.
"""

from __future__ import annotations

import bisect
import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshtron.config import SCHEDULES
from meshtron.errors import MeshtronError
from meshtron.parallel.pipeline.partition import placement_of, virtual_stage_of
from meshtron.parallel.pipeline.v_order import Cost, fitted_order, list_schedule, per_kind

COMPUTE_KINDS = ("F", "B", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    """One step of a stage: compute on (micro-batch, local chunk), or a send / receive post.

    For ``SEND_*`` the micro-batch and chunk are the sender's producing ones, for ``RECV_*`` the
    receiver's consuming ones; ``peer`` is the pipeline stage at the other end.
    """

    kind: str
    microbatch: int
    chunk: int
    peer: int | None = None

    def label(self, show_chunk: bool = False) -> str:
        """Short name such as ``F3``, or ``F3.1`` with the chunk."""
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if show_chunk else "")


Slot = tuple[float, float, Action]


@dataclass
class Schedule:
    """The per-stage action lists of one pipeline schedule, in execution order."""

    name: str
    pp: int
    vpp: int
    microbatches: int
    stages: list[list[Action]]
    receives_ahead: int = 0
    """How many messages past the consumed one each receive post reaches
    (:func:`add_communication`)."""
    costs: tuple[Cost, ...] | None = None
    """The virtual stages' relative costs the order was made for (zb-v; None: equal)."""

    @property
    def split_backward(self) -> bool:
        """True when ``B`` computes input gradients only and ``W`` the weight gradients."""
        return self.name in ("zb-h1", "zb-v")

    @property
    def vshape(self) -> bool:
        """True when the two chunks of each stage sit in a V (zb-v): stage 0 runs the first
        and the last virtual stage."""
        return self.name == "zb-v"

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.vpp

    def virtual(self, stage: int, chunk: int) -> int:
        """The virtual stage chunk ``chunk`` of ``stage`` runs."""
        return virtual_stage_of(self.pp, stage, chunk, self.vshape)

    def place(self, virtual: int) -> tuple[int, int]:
        """The (stage, chunk) that runs virtual stage ``virtual``."""
        return placement_of(self.pp, virtual, self.vshape)

    def compute_actions(self, stage: int) -> list[Action]:
        """The stage's ``F``/``B``/``W`` actions in order, without communication."""
        return [a for a in self.stages[stage] if a.kind in COMPUTE_KINDS]

    def default_costs(self) -> dict[str, float]:
        """Unit costs: F=1, B=2 (full backward), or F=B=W=1 when the backward is split."""
        return {"F": 1.0, "B": 1.0, "W": 1.0} if self.split_backward else {"F": 1.0, "B": 2.0}

    def dependencies(self, stage: int, action: Action) -> list[tuple[int, Action]]:
        """The (stage, compute action) pairs that must finish before ``action`` can start."""
        k, m = self.virtual(stage, action.chunk), action.microbatch
        last = self.num_virtual_stages - 1

        def at(kind: str, virtual: int) -> tuple[int, Action]:
            s, chunk = self.place(virtual)
            return s, Action(kind, m, chunk)

        if action.kind == "F":
            return [at("F", k - 1)] if k > 0 else []
        if action.kind == "B":
            return [at("B", k + 1)] if k < last else [at("F", k)]
        if action.kind == "W":
            return [at("B", k)]
        raise MeshtronError(f"'{action.kind}' is not a compute action; use one of F, B, W")

    def timeline(self, costs: dict[str, float] | None = None,
                 action_cost: Callable[[int, Action], float] | None = None) -> list[list[Slot]]:
        """(start, end, action) of every compute action per stage, each stage in list order.

        An action starts when its stage is free and the actions it depends on have ended;
        communication takes no time. ``costs`` prices each kind alike on every stage;
        ``action_cost(stage, action)``, when given, prices each action on its own (the cost
        model's unequal stages: the last one also runs the head and the loss).
        """
        cost = {**self.default_costs(), **(costs or {})}
        orders = [self.compute_actions(s) for s in range(self.pp)]
        ends: dict[tuple[int, Action], float] = {}
        rows: list[list[Slot]] = [[] for _ in range(self.pp)]
        clock = [0.0] * self.pp
        progressed = True
        while progressed:
            progressed = False
            for s, order in enumerate(orders):
                while len(rows[s]) < len(order):
                    action = order[len(rows[s])]
                    deps = self.dependencies(s, action)
                    if any(d not in ends for d in deps):
                        break
                    start = max([clock[s], *(ends[d] for d in deps)])
                    took = (cost[action.kind] if action_cost is None
                            else action_cost(s, action))
                    clock[s] = ends[(s, action)] = start + took
                    rows[s].append((start, clock[s], action))
                    progressed = True
        for s, order in enumerate(orders):
            if len(rows[s]) < len(order):
                stuck = order[len(rows[s])].label(self.vpp > 1)
                raise MeshtronError(f"schedule '{self.name}' deadlocks: stage {s} waits forever "
                                    f"before {stuck}")
        return rows

    def bubble_fraction(self, costs: dict[str, float] | None = None) -> float:
        """Idle time over pp × makespan in the simulated timeline."""
        rows = self.timeline(costs)
        makespan = max(row[-1][1] for row in rows if row)
        busy = sum(end - start for row in rows for start, end, _ in row)
        return (self.pp * makespan - busy) / (self.pp * makespan)

    def theoretical_bubble(self) -> float:
        """Closed-form bubble fraction under the default unit costs.

        gpipe, 1f1b: (p-1)/(m+p-1); interleaved: (p-1)/(v·m+p-1); zb-h1: (p-1)/(3m+p-1), the
        (p-1)·(F+B-W) idle time per stage of Qi et al. over a makespan of 3m+p-1; zb-v:
        (p-1)/(6m+p-1), only the last stage's wait for the first forward to reach it (p-1
        chunk forwards) over 6m chunk actions.
        """
        p, m = self.pp, self.microbatches
        if self.name == "interleaved":
            return (p - 1) / (self.vpp * m + p - 1)
        if self.name == "zb-h1":
            return (p - 1) / (3 * m + p - 1)
        if self.name == "zb-v":
            return (p - 1) / (6 * m + p - 1)
        return (p - 1) / (m + p - 1)

    def peak_in_flight(self) -> list[int]:
        """Per stage, the most (micro-batch, chunk) pairs whose forward ran and gradient did not.

        A pair leaves with its last gradient action: ``W`` when the backward is split, else ``B``.
        """
        done = "W" if self.split_backward else "B"
        peaks = []
        for s in range(self.pp):
            live = peak = 0
            for action in self.compute_actions(s):
                live += (action.kind == "F") - (action.kind == done)
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def table(self) -> list[str]:
        """One line per stage listing its compute actions, e.g. ``stage 0: F0 F1 B0 ...``."""
        return [f"stage {s}: " + " ".join(a.label(self.vpp > 1) for a in self.compute_actions(s))
                for s in range(self.pp)]


def add_communication(pp: int, vpp: int, compute: list[list[Action]],
                      ahead: int = 0, vshape: bool = False) -> list[list[Action]]:
    """Insert sends after producers and receive posts before consumers, matched in order.

    Every (sender, receiver) pair carries one ordered stream of messages; the receiver posts
    them in exactly the sender's order: right before a consumer it posts every not-yet-posted
    message of that sender up to the one consumed and, with ``ahead`` = n, the n after it too,
    so that those can arrive while this stage computes (a receive posted just before it is
    needed makes the stage wait for the whole hand-over; each one posted ahead holds one
    message's buffer longer). Chunks on the same stage (pp=1, or the turn of zb-v's V) hand
    activations over locally and get no actions.
    """
    last = pp * vpp - 1
    streams: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    sent: list[list[Action]] = []
    for s, actions in enumerate(compute):
        row: list[Action] = []
        for a in actions:
            row.append(a)
            target = _neighbour(a, virtual_stage_of(pp, s, a.chunk, vshape), last)
            if target is None or placement_of(pp, target, vshape)[0] == s:
                continue
            direction = a.kind  # "F" or "B"
            peer, chunk = placement_of(pp, target, vshape)
            row.append(Action(f"SEND_{direction}", a.microbatch, a.chunk, peer))
            streams.setdefault((s, peer), []).append((direction, a.microbatch, chunk))
        sent.append(row)

    index = {pair: {msg: i for i, msg in enumerate(msgs)} for pair, msgs in streams.items()}
    result: list[list[Action]] = []
    for r, actions in enumerate(sent):
        posted: dict[int, int] = {}
        row = []
        for a in actions:
            source = _neighbour(a, virtual_stage_of(pp, r, a.chunk, vshape), last, consumed=True)
            src = None if source is None else placement_of(pp, source, vshape)[0]
            if src is not None and src != r:
                stream, first = streams[(src, r)], posted.get(src, 0)
                upto = min(len(stream) - 1, index[(src, r)][(a.kind, a.microbatch, a.chunk)]
                           + ahead)
                row += [Action(f"RECV_{kind}", m, c, src) for kind, m, c in stream[first:upto + 1]]
                posted[src] = max(first, upto + 1)
            row.append(a)
        result.append(row)
    return result


def _neighbour(action: Action, virtual: int, last: int, consumed: bool = False) -> int | None:
    """The virtual stage that ``action`` sends to (or, with ``consumed``, receives from)."""
    if action.kind == "F":
        other = virtual - 1 if consumed else virtual + 1
    elif action.kind == "B":
        other = virtual + 1 if consumed else virtual - 1
    else:
        return None
    return other if 0 <= other <= last else None


def _interleaved_order(pp: int, vpp: int, microbatches: int, backward: bool) -> list[Action]:
    """Megatron's virtual micro-batch order: groups of pp micro-batches, chunk by chunk."""
    kind, order = ("B" if backward else "F"), []
    for k in range(microbatches * vpp):
        group, within = divmod(k, pp * vpp)
        chunk = within // pp
        order.append(Action(kind, group * pp + within % pp, vpp - 1 - chunk if backward else chunk))
    return order


def _one_f_one_b(forwards: list[Action], backwards: list[Action], warmup: int,
                 weight_delay: int | None = None) -> list[Action]:
    """Warm-up forwards, then alternate one forward and one backward, then the last backwards.

    With ``weight_delay`` (split backward) the ``W`` of each backward follows it, except that the
    first ``weight_delay`` of them are held back and run, oldest first, after later backwards
    and at the very end, where they fill what would be idle time.
    """
    order = forwards[:warmup]
    weights = [Action("W", b.microbatch, b.chunk) for b in backwards]
    pending = 0
    for i, backward in enumerate(backwards):
        if warmup + i < len(forwards):
            order.append(forwards[warmup + i])
        order.append(backward)
        if weight_delay is not None and i >= weight_delay:
            order.append(weights[pending])
            pending += 1
    if weight_delay is not None:
        order += weights[pending:]
    return order


def _zero_bubble_v(pp: int, microbatches: int,
                   costs: Sequence[Cost] | None = None) -> list[list[Action]]:
    """ZB-V (Qi et al., 2024): each stage's order list-scheduled on the chunks' costs
    (:mod:`.v_order`; ``costs[k]``: what each of F, B and W costs on virtual stage k, alike
    or as an (F, B, W) triple; None: 1 everywhere, which gives the makespan 6m + p - 1 for m
    a multiple of p). Unequal chunks (a head, half layers) get an order that fits them,
    admitting one micro-batch more than pp where that is clearly shorter
    (:func:`.v_order.fitted_order`)."""
    orders, _ = (list_schedule(pp, microbatches) if costs is None
                 else fitted_order(pp, microbatches, costs))
    return [[Action(*step) for step in order] for order in orders]


def _generate(name: str, pp: int, vpp: int, microbatches: int,
              costs: Sequence[Cost] | None = None) -> list[list[Action]]:
    forwards = [Action("F", m, 0) for m in range(microbatches)]
    backwards = [Action("B", m, 0) for m in range(microbatches)]
    if name == "gpipe":
        return [forwards + backwards for _ in range(pp)]
    if name == "1f1b":
        return [_one_f_one_b(forwards, backwards, pp - s - 1) for s in range(pp)]
    if name == "zb-h1":
        return [_one_f_one_b(forwards, backwards, pp - s - 1, weight_delay=s) for s in range(pp)]
    if name == "zb-v":
        return _zero_bubble_v(pp, microbatches, costs)
    forwards = _interleaved_order(pp, vpp, microbatches, backward=False)
    backwards = _interleaved_order(pp, vpp, microbatches, backward=True)
    return [_one_f_one_b(forwards, backwards, min((pp - s - 1) * 2 + (vpp - 1) * pp,
                                                  len(forwards)))
            for s in range(pp)]


def _validate(name: str, pp: int, vpp: int, microbatches: int) -> None:
    if name not in SCHEDULES:
        close = difflib.get_close_matches(name, SCHEDULES, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise MeshtronError(f"unknown pipeline schedule '{name}'; choose one of "
                            f"{', '.join(SCHEDULES)}{hint}")
    for label, value in (("pp", pp), ("vpp", vpp), ("microbatches", microbatches)):
        if value < 1:
            raise MeshtronError(f"{label} must be at least 1, got {value}")
    if name == "interleaved":
        if vpp < 2:
            raise MeshtronError(f"schedule 'interleaved' needs vpp >= 2 model chunks per stage, "
                                f"got vpp={vpp}; use schedule 1f1b for one chunk")
        if pp < 2:
            raise MeshtronError("schedule 'interleaved' needs pp >= 2 pipeline stages, got pp=1")
    elif name == "zb-v":
        if vpp != 2 or pp < 2:
            raise MeshtronError(f"schedule 'zb-v' places two chunks per stage in a V over "
                                f"pp >= 2 stages: set vpp=2 (got pp={pp}, vpp={vpp})")
    elif vpp > 1:
        raise MeshtronError(f"vpp={vpp} needs schedule 'interleaved' or 'zb-v', got schedule "
                            f"'{name}'")
    if name != "gpipe" and microbatches < pp:
        raise MeshtronError(f"schedule '{name}' needs at least pp={pp} micro-batches, got "
                            f"{microbatches}; raise train.global_batch or lower train.micro_batch")
    if name == "interleaved" and microbatches % pp:
        raise MeshtronError(f"schedule 'interleaved' needs the micro-batch count to be a multiple "
                            f"of pp={pp}, got {microbatches}; change train.global_batch or "
                            "train.micro_batch")


def receives_ahead_needed(schedule: Schedule) -> int:
    """The fewest messages each receive must be posted ahead (``receives_ahead``) so that, in
    the unit-cost timeline, every message is posted before its sender sends it.

    Gloo and NCCL move a message once both ends have posted it; a receive posted only when its
    consumer is next makes the stage wait for the whole hand-over. Receives are posted at a
    consumer of their stream, when the stage's previous action ends; the post at consumer i
    must therefore reach every message sent before the stream's next post. 1 for gpipe, 1f1b
    and zb-h1; for interleaved, whose sender sends its chunks' messages in bursts, 2-3 up to
    pp = 8, then about pp / 3. The need stops growing past 4 * pp micro-batches (checked for
    every schedule up to pp = 16 and 12 * pp micro-batches; a test keeps a sample), which
    :func:`build_schedule` uses to keep deep pipelines quick to plan.
    """
    rows = schedule.timeline()
    posted_at: dict[tuple[int, Action], float] = {}
    ended: dict[tuple[int, Action], float] = {}
    for s, row in enumerate(rows):
        previous_end = 0.0
        for _, end, action in row:
            posted_at[s, action], ended[s, action] = previous_end, end
            previous_end = end
    last = schedule.num_virtual_stages - 1
    sent: dict[tuple[int, int], list[tuple[tuple[str, int, int], float]]] = {}
    for s, row in enumerate(schedule.stages):
        for a in row:
            if a.kind.startswith("SEND_"):
                producer = Action(a.kind[-1], a.microbatch, a.chunk)
                target = _neighbour(producer, schedule.virtual(s, a.chunk), last)
                assert target is not None and a.peer is not None
                sent.setdefault((s, a.peer), []).append(
                    ((producer.kind, a.microbatch, schedule.place(target)[1]),
                     ended[s, producer]))
    needed = 0
    for r in range(schedule.pp):
        consumers: dict[int, list[Action]] = {}
        for a in schedule.compute_actions(r):
            source = _neighbour(a, schedule.virtual(r, a.chunk), last, consumed=True)
            src = None if source is None else schedule.place(source)[0]
            if src is not None and src != r:
                consumers.setdefault(src, []).append(a)
        for src, actions in consumers.items():
            stream = sent[src, r]
            index = {message: i for i, (message, _) in enumerate(stream)}
            send_times = [t for _, t in stream]  # in the sender's order: non-decreasing
            for i, a in enumerate(actions):
                next_post = (posted_at[r, actions[i + 1]] if i + 1 < len(actions)
                             else float("inf"))
                reached = bisect.bisect_right(send_times, next_post) - 1
                needed = max(needed, reached - index[a.kind, a.microbatch, a.chunk])
    return needed


def build_schedule(name: str, pp: int, vpp: int, microbatches: int,
                   receives_ahead: int | None = None,
                   costs: Sequence[Cost] | None = None) -> Schedule:
    """The named schedule for pp stages with vpp chunks each, communication included (each
    stream's receives posted ``receives_ahead`` messages early: :func:`add_communication`;
    None: :func:`receives_ahead_needed`, what the unit-cost timeline asks for). ``costs``:
    each virtual stage's relative cost of an F, B and W (one figure, or an (F, B, W) triple),
    which zb-v orders its actions by (None: equal); the other schedules' orders are fixed."""
    _validate(name, pp, vpp, microbatches)
    if costs is not None and (len(costs) != pp * vpp
                              or any(isinstance(c, tuple) and len(c) != 3 for c in costs)
                              or min(v for c in per_kind(costs, pp) for v in c.values()) <= 0):
        raise MeshtronError(f"pipeline costs need one positive value (or F, B, W triple) per "
                            f"virtual stage ({pp * vpp}), got {list(costs)}")
    compute, vshape = _generate(name, pp, vpp, microbatches, costs), name == "zb-v"
    if receives_ahead is None:  # past 4 * pp micro-batches the need no longer grows
        receives_ahead = (receives_ahead_needed(build_schedule(name, pp, vpp, 4 * pp, 0, costs))
                          if microbatches > 4 * pp else receives_ahead_needed(
            Schedule(name, pp, vpp, microbatches,
                     add_communication(pp, vpp, compute, vshape=vshape))))
    return Schedule(name, pp, vpp, microbatches,
                    add_communication(pp, vpp, compute, receives_ahead, vshape), receives_ahead,
                    tuple(costs) if costs is not None else None)
