"""The zb-v split that balances stages rather than virtual stages.

In zb-v's V, stage ``s`` runs virtual stages ``s`` and ``2 pp - 1 - s``: a run of layers from
the front of the model and one from the back, stage 0 also the embedding and the head, stage
``pp - 1`` the middle run cut in two at the turn of the V. When the head costs more than an
average virtual stage (few layers, a large vocabulary), balancing the virtual stages leaves
stage 0 the busiest; this split minimises the busiest *stage* instead.

It bisects on the bound. For one bound, the stages are filled from the outside in: each takes
a run from the front and one from the back, within the bound, and what stays open is the
middle. Only the middles that no other middle contains are kept (taking more now never makes
the rest harder), so each stage looks at a frontier of at most one middle per front position.
"""

from __future__ import annotations

import bisect

Middle = dict[int, tuple[int, list[tuple[int, int]]]]
"""Front position -> (back position, the (front, back) piece counts of the stages so far)."""


def v_balanced_splits(pieces: list[float], pp: int, head_cost: float, first_cost: float = 0.0,
                      even_turn: bool = False) -> list[list[int]]:
    """Splits in pieces per virtual stage (2 pp of them, in model order, each at least one)
    minimising the busiest stage of the V, one per way of filling the outer stages that the
    search kept (they differ in how the work of a stage divides between its two chunks);
    ``even_turn``: the turn falls after an even number of pieces (a whole layer where pieces
    are halves). Empty when no split exists."""
    ends = [0.0]
    for cost in pieces:
        ends.append(ends[-1] + cost)
    extras = head_cost + first_cost
    low, high = (ends[-1] + extras) / pp, ends[-1] + extras
    best = _fill(ends, pp, extras, high, even_turn)
    if not best:
        return []
    while high - low > 1e-9 * high:
        middle = (low + high) / 2
        found = _fill(ends, pp, extras, middle, even_turn)
        if not found:
            low = middle
        else:
            high, best = middle, found
    return best


def _fill(ends: list[float], pp: int, extras: float, bound: float,
          even_turn: bool) -> list[list[int]]:
    """The splits (counts per virtual stage) with every stage within ``bound``, one per middle
    left open for the last stage; empty when there is none."""
    n = len(ends) - 1
    slack = 1e-12 * max(1.0, bound)
    middles: Middle = {0: (n, [])}
    for stage in range(pp - 1):
        extra = extras if stage == 0 else 0.0
        later = 2 * (pp - 1 - stage)  # pieces the inner stages need at least
        grown: Middle = {}
        for front, (back, taken) in middles.items():
            for new_front in range(front + 1, back - later):
                budget = bound - (ends[new_front] - ends[front]) - extra
                if budget < 0:
                    break
                new_back = max(bisect.bisect_left(ends, ends[back] - budget - slack),
                               new_front + later)
                if new_back <= back - 1 and (new_front not in grown
                                             or new_back < grown[new_front][0]):
                    grown[new_front] = (new_back, [*taken, (new_front - front,
                                                            back - new_back)])
        middles = _innermost(grown)
    splits = []
    for front, (back, taken) in sorted(middles.items()):
        if ends[back] - ends[front] + (extras if pp == 1 else 0.0) > bound + slack:
            continue
        turns = [t for t in range(front + 1, back) if not (even_turn and t % 2)]
        if not turns:
            continue
        turn = min(turns, key=lambda t: max(ends[t] - ends[front], ends[back] - ends[t]))
        fronts = [f for f, _ in taken] + [turn - front]
        backs = [b for _, b in taken] + [back - turn]
        splits.append(fronts + backs[::-1])
    return splits


def _innermost(middles: Middle) -> Middle:
    """The middles no other one lies inside (a later front and an earlier or equal back)."""
    kept: Middle = {}
    closest = None
    for front in sorted(middles, reverse=True):
        back = middles[front][0]
        if closest is None or back < closest:
            kept[front], closest = middles[front], back
    return kept
