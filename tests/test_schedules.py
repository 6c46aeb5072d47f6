"""Pipeline schedules as data: completeness, matched communication, bubble and memory theory."""

from __future__ import annotations

from collections import Counter, deque

import pytest

from meshtron.errors import MeshtronError
from meshtron.parallel.pipeline.completions import send_completions
from meshtron.parallel.pipeline.schedules import (
    COMM_KINDS,
    Action,
    Schedule,
    add_communication,
    build_schedule,
    receives_ahead_needed,
)


def grid() -> list[tuple[str, int, int, int]]:
    """Every schedule over small layouts, with M == pp and M > pp where the schedule allows."""
    cases = []
    for pp in range(1, 5):
        for m in sorted({pp, pp + 1, 2 * pp, 8}):
            cases += [("gpipe", pp, 1, m), ("1f1b", pp, 1, m), ("zb-h1", pp, 1, m)]
        if pp >= 2:
            cases += [("interleaved", pp, v, m) for v in (2, 3) for m in (pp, 2 * pp, 3 * pp)]
            cases += [("zb-v", pp, 2, m) for m in sorted({pp, pp + 1, 2 * pp, 8})]
    cases += [("gpipe", 4, 1, 2), ("gpipe", 3, 1, 1)]  # GPipe allows fewer micro-batches than pp
    return cases


GRID = grid()
IDS = [f"{n}-pp{p}-vpp{v}-m{m}" for n, p, v, m in GRID]


def virtual(schedule: Schedule, stage: int, action: Action) -> int:
    return schedule.virtual(stage, action.chunk)


def stage_of(schedule: Schedule, virtual_stage: int) -> int:
    return schedule.place(virtual_stage)[0]


@pytest.mark.parametrize("case", GRID, ids=IDS)
def test_every_compute_action_exactly_once(case):
    s = build_schedule(*case)
    kinds = ("F", "B", "W") if s.split_backward else ("F", "B")
    expected = Counter(Action(k, m, c) for k in kinds for m in range(s.microbatches)
                       for c in range(s.vpp))
    for stage in range(s.pp):
        assert Counter(s.compute_actions(stage)) == expected
        assert all(a.peer is None for a in s.compute_actions(stage))
        assert all(a.kind in kinds or a.kind in COMM_KINDS for a in s.stages[stage])


def streams(s: Schedule, kind: str) -> dict[tuple[int, int], list[tuple[str, int, int]]]:
    """Per (sender, receiver): the messages in the order the sender sends or the receiver posts.

    Each message is (direction, micro-batch, chunk at the receiver).
    """
    out: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for stage, row in enumerate(s.stages):
        for a in row:
            if a.kind == f"SEND_{kind[-1]}" and kind.startswith("SEND"):
                k = virtual(s, stage, a) + (1 if a.kind == "SEND_F" else -1)
                assert stage_of(s, k) == a.peer
                out.setdefault((stage, a.peer), []).append((a.kind[-1], a.microbatch,
                                                            s.place(k)[1]))
            if a.kind == f"RECV_{kind[-1]}" and kind.startswith("RECV"):
                out.setdefault((a.peer, stage), []).append((a.kind[-1], a.microbatch, a.chunk))
    return out


@pytest.mark.parametrize("case", GRID, ids=IDS)
def test_sends_and_receives_match_in_order_per_pair(case):
    s = build_schedule(*case)
    for direction in ("F", "B"):
        assert streams(s, f"SEND_{direction}") == streams(s, f"RECV_{direction}")
    if s.pp == 1:
        assert all(a.kind not in COMM_KINDS for a in s.stages[0])
    last = s.pp * s.vpp - 1
    sends = Counter()
    for stage, row in enumerate(s.stages):
        for i, a in enumerate(row):
            k = virtual(s, stage, a)
            if a.kind in ("F", "B"):
                produces = (a.kind == "F" and k < last) or (a.kind == "B" and k > 0)
                target = k + (1 if a.kind == "F" else -1)
                following = row[i + 1] if i + 1 < len(row) else None
                assert (following == Action(f"SEND_{a.kind}", a.microbatch, a.chunk,
                                            stage_of(s, target) if produces else None)) == (
                    produces and stage_of(s, target) != stage)
            sends[a.kind] += a.kind.startswith("SEND")
    # one message per boundary between virtual stages on two stages, per micro-batch, each way
    crossings = sum(stage_of(s, k) != stage_of(s, k + 1) for k in range(last))
    assert crossings == (0 if s.pp == 1 else last - s.vshape)
    assert sends["SEND_F"] == sends["SEND_B"] == crossings * s.microbatches


def consumed(s: Schedule, stage: int, a: Action) -> tuple[int, tuple[str, int, int]] | None:
    """(sender stage, message) that compute action ``a`` needs from another stage, if any."""
    k, last = virtual(s, stage, a), s.pp * s.vpp - 1
    source = k - 1 if a.kind == "F" else k + 1 if a.kind == "B" else -1
    if not 0 <= source <= last or stage_of(s, source) == stage:
        return None
    return stage_of(s, source), (a.kind, a.microbatch, a.chunk)


@pytest.mark.parametrize("case", GRID, ids=IDS)
def test_receives_are_posted_before_their_consumers_and_as_late_as_allowed(case):
    """With ``receives_ahead=0``; the default posts ahead (the tests below)."""
    s = build_schedule(*case, receives_ahead=0)
    for stage, row in enumerate(s.stages):
        posted: set[tuple[int, tuple[str, int, int]]] = set()
        run: list[Action] = []  # receive posts since the last other action
        for a in row:
            if a.kind.startswith("RECV"):
                run.append(a)
                posted.add((a.peer, (a.kind[-1], a.microbatch, a.chunk)))
                continue
            need = consumed(s, stage, a)
            assert need is None or need in posted, (stage, a)
            if run:
                # posts come only right before a consumer, from its sender, ending with the
                # message it consumes (earlier ones are required by the sender's order)
                assert need is not None and all(r.peer == need[0] for r in run)
                assert (run[-1].kind[-1], run[-1].microbatch, run[-1].chunk) == need[1]
            run = []
        assert not run


def run_globally(s: Schedule) -> list[list[tuple[float, float, Action]]]:
    """Execute all stages together: sends are non-blocking and matched in order per pair;
    a compute action waits for its received input and for the stage; F=1, B=2 (or 1, W=1).

    Returns per-stage (start, end, compute action); fails on a deadlock or a mismatch.
    """
    cost = s.default_costs()
    wire: dict[tuple[int, int], deque] = {}  # sent, not yet matched to a post: (msg, time)
    posts: dict[tuple[int, int], deque] = {}  # posted receives not yet matched
    arrived: dict[tuple[int, tuple], float] = {}  # (receiver, msg) -> time available
    clock, pos = [0.0] * s.pp, [0] * s.pp
    rows: list[list] = [[] for _ in range(s.pp)]
    last = s.pp * s.vpp - 1

    def match(pair: tuple[int, int]) -> None:
        while wire.get(pair) and posts.get(pair):
            msg, t = wire[pair].popleft()
            assert posts[pair].popleft() == msg, "receive posted out of the sender's order"
            arrived[(pair[1], msg)] = t

    progressed = True
    while progressed:
        progressed = False
        for stage, row in enumerate(s.stages):
            while pos[stage] < len(row):
                a = row[pos[stage]]
                k = virtual(s, stage, a)
                if a.kind.startswith("SEND"):
                    target = k + (1 if a.kind == "SEND_F" else -1)
                    msg = (a.kind[-1], a.microbatch, s.place(target)[1])
                    wire.setdefault((stage, a.peer), deque()).append((msg, clock[stage]))
                    match((stage, a.peer))
                elif a.kind.startswith("RECV"):
                    posts.setdefault((a.peer, stage), deque()).append(
                        (a.kind[-1], a.microbatch, a.chunk))
                    match((a.peer, stage))
                else:
                    ready, need = clock[stage], consumed(s, stage, a)
                    if need is not None:
                        if (stage, need[1]) not in arrived:
                            break
                        ready = max(ready, arrived.pop((stage, need[1])))
                    if a.kind == "B" and k == last:
                        assert any(x == Action("F", a.microbatch, a.chunk) for *_, x in rows[stage])
                    if a.kind == "W":
                        assert any(x == Action("B", a.microbatch, a.chunk) for *_, x in rows[stage])
                    rows[stage].append((ready, ready + cost[a.kind], a))
                    clock[stage] = ready + cost[a.kind]
                pos[stage] += 1
                progressed = True
    stuck = {st: s.stages[st][pos[st]] for st in range(s.pp) if pos[st] < len(s.stages[st])}
    assert not stuck, f"deadlock at {stuck}"
    assert not arrived and all(not q for q in wire.values()) and all(not q for q in posts.values())
    return rows


@pytest.mark.parametrize("case", GRID, ids=IDS)
def test_global_execution_respects_dependencies_and_agrees_with_the_timeline(case):
    s = build_schedule(*case)
    rows = run_globally(s)
    assert rows == s.timeline()


@pytest.mark.parametrize("case", GRID, ids=IDS)
def test_simulated_bubble_equals_theory(case):
    s = build_schedule(*case)
    p, m, v = s.pp, s.microbatches, s.vpp
    formula = {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1),
               "interleaved": (p - 1) / (v * m + p - 1), "zb-h1": (p - 1) / (3 * m + p - 1),
               "zb-v": (p - 1) / (6 * m + p - 1)}
    assert s.theoretical_bubble() == pytest.approx(formula[s.name], abs=1e-15)
    if s.name == "zb-v" and m % p:  # its order reaches the bound for multiples of pp
        assert s.theoretical_bubble() < s.bubble_fraction() < 3 * s.theoretical_bubble()
    else:
        assert s.bubble_fraction() == pytest.approx(s.theoretical_bubble(), abs=1e-12)


@pytest.mark.parametrize("case", [c for c in GRID if c[0] == "zb-h1" and c[1] > 1],
                         ids=[i for c, i in zip(GRID, IDS) if c[0] == "zb-h1" and c[1] > 1])
def test_zero_bubble_h1_has_a_third_of_the_1f1b_bubble_at_the_same_peak(case):
    _, p, _, m = case
    zb, one = build_schedule(*case), build_schedule("1f1b", p, 1, m)
    # idle time per stage: (p-1)·(F+B-W) = p-1 against 1F1B's (p-1)·(F+B) = 3(p-1)
    idle_zb = zb.bubble_fraction() * (3 * m + p - 1)
    idle_one = one.bubble_fraction() * 3 * (m + p - 1)
    assert idle_zb == pytest.approx(p - 1) and idle_one == pytest.approx(3 * (p - 1))
    # so the fraction is a third of 1F1B's, up to the shorter makespan it divides by
    ratio = zb.bubble_fraction() / one.bubble_fraction()
    assert ratio == pytest.approx((m + p - 1) / (3 * m + p - 1))
    assert 1 / 3 < ratio <= 1 / 3 + 2 * (p - 1) / (3 * (3 * m + p - 1)) + 1e-12
    # the memory bound of 1F1B (p micro-batches on its fullest stage) holds on every stage
    assert max(zb.peak_in_flight()) == max(one.peak_in_flight()) == p


@pytest.mark.parametrize("case", GRID, ids=IDS)
def test_peak_in_flight_equals_theory(case):
    s = build_schedule(*case)
    p, m, v = s.pp, s.microbatches, s.vpp
    if s.name == "gpipe":
        expected = [m] * p
    elif s.name == "1f1b":
        expected = [min(p - st, m) for st in range(p)]
    elif s.name == "zb-h1":
        expected = [min(p, m)] * p
    elif s.name == "zb-v":  # chunks: 1F1B's bound of p micro-batches on a stage, 2 chunks each
        expected = [min(2 * p, 2 * m)] * p
    else:
        expected = [min((p - st - 1) * 2 + (v - 1) * p + 1, m * v) for st in range(p)]
    assert s.peak_in_flight() == expected


def test_costs_change_the_timeline():
    s = build_schedule("1f1b", 2, 1, 4)
    assert s.bubble_fraction({"B": 1.0}) == pytest.approx(1 / 5)
    assert s.timeline({"F": 2.0, "B": 4.0})[-1][-1][1] == 2 * s.timeline()[-1][-1][1]


def test_table_shows_chunks_only_when_interleaved():
    assert build_schedule("1f1b", 2, 1, 3).table() == ["stage 0: F0 F1 B0 F2 B1 B2",
                                                       "stage 1: F0 B0 F1 B1 F2 B2"]
    assert build_schedule("interleaved", 2, 2, 2).table()[1].startswith("stage 1: F0.0 F1.0 F0.1")


def test_split_backward_only_for_zero_bubble():
    assert build_schedule("zb-h1", 2, 1, 2).split_backward
    assert build_schedule("zb-v", 2, 2, 2).split_backward
    assert not any(build_schedule(n, 2, v, 2).split_backward
                   for n, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)))


@pytest.mark.parametrize("args, words", [
    (("1fb1", 2, 1, 4), ["unknown pipeline schedule '1fb1'", "gpipe, 1f1b, interleaved, zb-h1",
                         "did you mean '1f1b'"]),
    (("pipedream", 2, 1, 4), ["unknown pipeline schedule 'pipedream'", "choose one of"]),
    (("1f1b", 0, 1, 4), ["pp must be at least 1, got 0"]),
    (("1f1b", 2, 0, 4), ["vpp must be at least 1, got 0"]),
    (("gpipe", 2, 1, 0), ["microbatches must be at least 1, got 0"]),
    (("1f1b", 4, 1, 3), ["needs at least pp=4 micro-batches, got 3", "train.global_batch",
                         "train.micro_batch"]),
    (("zb-h1", 3, 1, 2), ["needs at least pp=3 micro-batches, got 2"]),
    (("interleaved", 4, 2, 2), ["needs at least pp=4 micro-batches, got 2"]),
    (("interleaved", 4, 2, 6), ["multiple of pp=4, got 6"]),
    (("interleaved", 2, 1, 4), ["needs vpp >= 2", "got vpp=1"]),
    (("interleaved", 1, 2, 4), ["needs pp >= 2"]),
    (("1f1b", 2, 2, 4), ["vpp=2 needs schedule 'interleaved'"]),
    (("gpipe", 2, 3, 4), ["vpp=3 needs schedule 'interleaved' or 'zb-v'"]),
    (("zb-v", 2, 1, 4), ["'zb-v' places two chunks per stage in a V", "set vpp=2"]),
    (("zb-v", 1, 2, 4), ["over pp >= 2 stages", "got pp=1, vpp=2"]),
    (("zb-v", 2, 3, 4), ["set vpp=2", "got pp=2, vpp=3"]),
    (("zb-v", 3, 2, 2), ["needs at least pp=3 micro-batches, got 2"]),
    (("zb-v", 2, 2, 4, None, [1.0, 1.0, 1.0]), ["one positive value (or F, B, W triple) per "
                                                "virtual stage (4)"]),
    (("zb-v", 2, 2, 4, None, [1.0, 0.0, 1.0, 1.0]), ["one positive value"]),
    (("zb-v", 2, 2, 4, None, [(1.0, 1.0), 1.0, 1.0, 1.0]), ["F, B, W triple"]),
])
def test_bad_input_raises_one_clear_sentence(args, words):
    with pytest.raises(MeshtronError) as err:
        build_schedule(*args)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_receives_posted_in_the_senders_order_when_consumed_out_of_order():
    f, b = (lambda m: Action("F", m, 0)), (lambda m: Action("B", m, 0))
    stages = add_communication(2, 1, [[f(0), f(1), b(1), b(0)], [f(1), b(1), f(0), b(0)]])
    assert stages[1] == [Action("RECV_F", 0, 0, 0), Action("RECV_F", 1, 0, 0), f(1), b(1),
                         Action("SEND_B", 1, 0, 0), f(0), b(0), Action("SEND_B", 0, 0, 0)]
    assert stages[0] == [f(0), Action("SEND_F", 0, 0, 1), f(1), Action("SEND_F", 1, 0, 1),
                         Action("RECV_B", 1, 0, 1), b(1), Action("RECV_B", 0, 0, 1), b(0)]
    schedule = Schedule("1f1b", 2, 1, 2, stages)
    assert run_globally(schedule) == schedule.timeline()


# ------------------------------------------------------------------ when sends are let go


def run_with_blocking_send_waits(schedule: Schedule, waits: list[dict[int, list[int]]]) -> bool:
    """Execute every stage's actions under gloo's rules: a receive post never blocks, a
    compute action blocks until the message it consumes has been sent, and waiting for a
    send blocks until the peer has posted its receive. ``waits``: per stage, the sends to
    wait for after each action index. True when every stage gets to the end."""
    pp = schedule.pp
    sent, posted = set(), set()
    position = [0] * pp
    rows = schedule.stages

    def message(stage: int, a: Action) -> tuple:
        """(from, to, direction, micro-batch, receiving virtual stage) of a send or receive."""
        if a.kind.startswith("SEND_"):
            step = 1 if a.kind == "SEND_F" else -1
            return stage, a.peer, a.kind[-1], a.microbatch, virtual(schedule, stage, a) + step
        return a.peer, stage, a.kind[-1], a.microbatch, virtual(schedule, stage, a)

    consumes = [{(a.kind[-1], a.microbatch, a.chunk): message(s, a) for a in row
                 if a.kind.startswith("RECV_")} for s, row in enumerate(rows)]
    progressed = True
    while progressed:
        progressed = False
        for s in range(pp):
            while position[s] < len(rows[s]):
                i, a = position[s], rows[s][position[s]]
                needed = consumes[s].get((a.kind, a.microbatch, a.chunk))
                if a.kind in ("F", "B") and needed is not None and needed not in sent:
                    break
                if any(message(s, rows[s][j]) not in posted for j in waits[s].get(i, ())):
                    break
                if a.kind.startswith("SEND_"):
                    sent.add(message(s, a))
                elif a.kind.startswith("RECV_"):
                    posted.add(message(s, a))
                position[s] += 1
                progressed = True
    return all(position[s] == len(rows[s]) for s in range(pp))


@pytest.mark.parametrize("case", [c for c in grid() if c[1] > 1])
def test_sends_are_let_go_early_without_deadlock(case):
    """Waiting where :func:`send_completions` says never deadlocks (waiting right after each
    send would, for 1F1B), and 1F1B then keeps a bounded number of sends open."""
    schedule = build_schedule(*case)
    completions = send_completions(schedule)
    assert run_with_blocking_send_waits(schedule, completions), case
    for stage, row in enumerate(schedule.stages):
        for after, sends in completions[stage].items():
            assert all(row[j].kind.startswith("SEND_") and j <= after for j in sends)
    if case[0] == "1f1b" and case[3] > case[1]:  # with receives posted as late as allowed
        late = build_schedule(*case, receives_ahead=0)
        late_completions = send_completions(late)
        eager = [{i: [i] for i, a in enumerate(row) if a.kind.startswith("SEND_")}
                 for row in late.stages]
        assert not run_with_blocking_send_waits(late, eager), case
        kept_open = [sum(a.kind.startswith("SEND_") for a in row)
                     - sum(len(v) for v in late_completions[stage].values())
                     for stage, row in enumerate(late.stages)]
        assert max(kept_open) <= case[1], kept_open  # at most pp, whatever the micro-batches


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("case", [c for c in GRID if c[1] > 1], ids=lambda c: "-".join(map(str, c)))
def test_receives_posted_ahead_keep_the_order_the_timeline_and_no_deadlock(case, ahead):
    """Posting each stream's next receives early changes no match, no compute time and no
    safe moment to let a send go: only when the hand-over can happen."""
    late = build_schedule(*case, receives_ahead=0)
    early = build_schedule(*case, receives_ahead=ahead)
    assert [late.compute_actions(s) for s in range(late.pp)] == \
        [early.compute_actions(s) for s in range(early.pp)]
    assert run_globally(early) == early.timeline() == late.timeline()
    assert run_with_blocking_send_waits(early, send_completions(early)), case
    for stage, row in enumerate(early.stages):  # never more than `ahead` posts unconsumed
        open_posts: dict[int, int] = {}
        for a in row:
            if a.kind.startswith("RECV"):
                open_posts[a.peer] = open_posts.get(a.peer, 0) + 1
            elif (need := consumed(early, stage, a)) is not None:
                assert open_posts[need[0]] <= ahead + 1, (stage, a)
                open_posts[need[0]] -= 1


def posted_late(schedule: Schedule) -> int:
    """How many messages, in the unit-cost timeline, are sent no later than the moment the
    receiver posts them (a tie is a race: late), not counting those posted at the stream's
    first post (the receiver posts nothing earlier)."""
    rows = schedule.timeline()
    ended = {(s, a): end for s, row in enumerate(rows) for _, end, a in row}
    late = 0
    for r, row in enumerate(schedule.stages):
        now, first_post = 0.0, {}
        for a in row:
            if a.kind in ("F", "B", "W"):
                now = ended[r, a]
                continue
            if not a.kind.startswith("RECV_"):
                continue
            kind = a.kind[-1]
            source = virtual(schedule, r, a) + (-1 if kind == "F" else 1)
            sender, chunk = schedule.place(source)
            sent = ended[sender, Action(kind, a.microbatch, chunk)]
            first_post.setdefault(a.peer, now)
            late += first_post[a.peer] < now and sent <= now
    return late


@pytest.mark.parametrize("case", [c for c in GRID if c[1] > 1], ids=lambda c: "-".join(map(str, c)))
def test_the_default_posts_every_receive_before_its_message_is_sent(case):
    """build_schedule's default ``receives_ahead`` is the fewest posts ahead with which no
    message waits for its receive in the unit-cost timeline: one fewer leaves one waiting."""
    schedule = build_schedule(*case)
    assert schedule.receives_ahead == receives_ahead_needed(schedule)
    assert posted_late(schedule) == 0, case
    if schedule.receives_ahead > 0:
        assert posted_late(build_schedule(*case, receives_ahead=schedule.receives_ahead - 1)) > 0


@pytest.mark.parametrize("case", [c for c in GRID if c[1] > 1 and c[2] == 1],
                         ids=lambda c: "-".join(map(str, c)))
def test_one_receive_ahead_is_enough_without_interleaving(case):
    """At most one (none with a single micro-batch): what the cost model's memory estimate
    takes for every non-interleaved schedule."""
    assert build_schedule(*case).receives_ahead == min(1, case[3] - 1)


def test_receives_ahead_defaults():
    """One message ahead for gpipe, 1f1b and zb-h1; interleaving sends in bursts and needs more
    (3 at pp=2: what the measured pipeline needed, docs/performance.md)."""
    assert [build_schedule(n, 4, 1, 8).receives_ahead for n in ("gpipe", "1f1b", "zb-h1")] \
        == [1, 1, 1]
    assert build_schedule("interleaved", 2, 2, 8).receives_ahead == 3
    assert build_schedule("1f1b", 1, 1, 4).receives_ahead == 0  # no pipeline, no messages


@pytest.mark.parametrize("case", [("interleaved", 3, 2, 18), ("1f1b", 2, 1, 12),
                                  ("zb-h1", 3, 1, 15), ("gpipe", 2, 1, 11)])
def test_the_default_for_many_micro_batches_is_that_of_4_pp(case):
    """Past 4 * pp micro-batches the default is read off a 4 * pp schedule: the same value
    as the whole schedule's."""
    assert build_schedule(*case).receives_ahead == \
        receives_ahead_needed(build_schedule(*case, receives_ahead=0))
