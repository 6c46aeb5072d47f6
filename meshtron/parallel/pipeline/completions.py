"""When each send of a schedule is known to be complete, so its tensor can be let go.

A non-blocking send keeps its tensor until the transport is done with it, and gloo only knows
that when asked to wait; waiting too early can deadlock (the peer has not posted the receive,
and waits for us). Waiting at the end of the step is safe but keeps one message per
micro-batch alive, memory that grows with the number of micro-batches where 1F1B promises a
bound. The schedule tells a safe earlier moment: once a stage has received a message that its
peer sent *after* posting the receive of ours, ours has somewhere to go, so waiting for it only
waits for the transfer (the peer's transport does it in the background).
"""

from __future__ import annotations

from meshtron.parallel.pipeline.schedules import Action, Schedule

Message = tuple[str, int, int]
"""(direction, micro-batch, the receiver's chunk): what a stream between two stages carries."""


def _sent_message(schedule: Schedule, stage: int, send: Action) -> Message:
    direction = send.kind[-1]
    virtual = schedule.virtual(stage, send.chunk) + (1 if direction == "F" else -1)
    return direction, send.microbatch, schedule.place(virtual)[1]


def _consumer(action: Action) -> Message | None:
    """The message a compute action waits for before it starts (if it gets one)."""
    if action.kind not in ("F", "B"):
        return None
    return action.kind, action.microbatch, action.chunk


def send_completions(schedule: Schedule) -> list[dict[int, list[int]]]:
    """Per stage: {index of an action: indices of this stage's sends that are complete once
    that action has run}. Sends without such an action are waited for at the end of the step.
    """
    stages = schedule.stages
    posts = [{(a.peer, (a.kind[-1], a.microbatch, a.chunk)): i for i, a in enumerate(row)
              if a.kind.startswith("RECV_")} for row in stages]
    consumed_at = [{_consumer(a): i for i, a in enumerate(row) if _consumer(a) is not None}
                   for row in stages]
    out: list[dict[int, list[int]]] = [{} for _ in stages]
    for stage, row in enumerate(stages):
        for index, send in enumerate(row):
            if not send.kind.startswith("SEND_"):
                continue
            peer = send.peer
            assert peer is not None
            posted = posts[peer][(stage, _sent_message(schedule, stage, send))]
            reply = next((a for a in stages[peer][posted + 1:]
                          if a.kind.startswith("SEND_") and a.peer == stage), None)
            if reply is None:
                continue
            arrives = consumed_at[stage][_sent_message(schedule, peer, reply)]
            out[stage].setdefault(max(index, arrives), []).append(index)
    return out
