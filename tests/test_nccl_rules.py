"""Pipeline communication under NCCL's rules, simulated (there is no GPU here to run it).

NCCL runs the operations of one process group in order on one stream: an operation starts
once the one before it on that stream has completed and the compute issued before it has run,
and a large message moves only once both its send and its receive have started. A schedule
deadlocks under these rules when some stage can never run its next action. gloo has no such
order, so the parity tests cannot show it. These tests say why the executor sends each
direction between two stages over a group of its own (``ParallelMesh.pp_sends`` and
``pp_receives``) rather than over the pipeline group.
"""

from __future__ import annotations

import pytest

from meshtron.parallel.pipeline.schedules import COMPUTE_KINDS, Schedule, build_schedule


def operations(schedule: Schedule, shared: bool) -> list[list[tuple]]:
    """Per stage, its sends and receive posts in issue order: (stream, computes issued before,
    SEND or RECV, message). A message is (direction, micro-batch, receiving virtual stage). A
    stream is the pair's group on this stage (``shared``: one group for both directions), or
    the group of one direction."""
    out = []
    for stage, row in enumerate(schedule.stages):
        issued, computes = [], 0
        for a in row:
            if a.kind in COMPUTE_KINDS:
                computes += 1
                continue
            direction, virtual = a.kind[-1], schedule.virtual(stage, a.chunk)
            kind = a.kind[:4]
            if kind == "SEND":
                virtual += 1 if direction == "F" else -1
            stream = (stage, a.peer) if shared else (stage, a.peer, kind)
            issued.append((stream, computes, kind, (direction, a.microbatch, virtual)))
        out.append(issued)
    return out


def deadlocks(schedule: Schedule, shared: bool) -> bool:
    """Whether some stage never finishes under NCCL's rules (see the module docstring)."""
    pp, last = schedule.pp, schedule.pp * schedule.vpp - 1
    issued = operations(schedule, shared)
    computes = [schedule.compute_actions(s) for s in range(pp)]
    ran, started, moved = [0] * pp, set(), set()
    progressed = True
    while progressed:
        progressed = False
        for s in range(pp):
            for i, (stream, before, kind, message) in enumerate(issued[s]):
                previous = [op for op in issued[s][:i] if op[0] == stream]
                if ((kind, message) not in started and ran[s] >= before
                        and (not previous or previous[-1][3] in moved)):
                    started.add((kind, message))
                    progressed = True
            for kind, message in list(started):
                if kind == "SEND" and message not in moved and ("RECV", message) in started:
                    moved.add(message)
                    progressed = True
            while ran[s] < len(computes[s]):
                a = computes[s][ran[s]]
                virtual = schedule.virtual(s, a.chunk)
                source = virtual - 1 if a.kind == "F" else virtual + 1 if a.kind == "B" else -1
                if 0 <= source <= last and schedule.place(source)[0] != s and \
                        (a.kind, a.microbatch, virtual) not in moved:
                    break
                ran[s] += 1
                progressed = True
    return any(ran[s] < len(computes[s]) for s in range(pp))


CASES = [(name, pp, 1, m) for name in ("gpipe", "1f1b", "zb-h1") for pp in (2, 3, 4)
         for m in sorted({pp, 2 * pp, 5 * pp})]
CASES += [("interleaved", pp, v, m) for pp in (2, 3, 4) for v in (2, 3) for m in (pp, 5 * pp)]
CASES += [("zb-v", pp, 2, m) for pp in (2, 3, 4) for m in (pp, pp + 1, 5 * pp)]


@pytest.mark.parametrize("ahead", [0, None])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_a_group_per_direction_never_deadlocks(case, ahead):
    """Every schedule, with receives posted late or by the default ahead."""
    assert not deadlocks(build_schedule(*case, receives_ahead=ahead), shared=False), case


@pytest.mark.parametrize("case", [("1f1b", 2, 1, 4), ("zb-h1", 3, 1, 6),
                                  ("interleaved", 2, 2, 4)])
def test_one_group_for_both_directions_deadlocks(case):
    """What a shared group does: in 1F1B, stage 1 queues the gradient it sends behind its
    receive of the next activation, while stage 0 queues that activation's send behind its
    receive of the gradient."""
    assert deadlocks(build_schedule(*case, receives_ahead=0), shared=True)
