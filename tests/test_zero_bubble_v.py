"""zb-v's schedule: the V placement, its idle time and the order fitted to the chunks' costs
(the checks common to every schedule run over a grid in test_schedules.py)."""

from __future__ import annotations

import re

import pytest

from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.parallel.pipeline.measured_order import MeasuredOrder
from meshtron.parallel.pipeline.schedules import build_schedule
from meshtron.parallel.pipeline.v_order import WORTH_ONE_MORE, list_schedule, replay
from meshtron.plan import check_run
from meshtron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.parity import test_overrides


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zero_bubble_v_places_chunks_in_a_v_and_idles_only_while_the_first_forward_travels(pp):
    """Stage s runs virtual stages s and 2pp-1-s, so stage 0 holds the embedding and the head
    and the turn of the V is a hand-over in memory on stage pp-1. With F = B = W = 1 per chunk
    every stage is idle p-1 units in a makespan of 6m + p - 1, a sixth of 1F1B's idle time
    (3(p-1) units of whole-stage work = 6(p-1) chunk units) at 1F1B's activation bound."""
    for m in (pp, 2 * pp, 4 * pp):
        s = build_schedule("zb-v", pp, 2, m)
        assert [(s.virtual(st, 0), s.virtual(st, 1)) for st in range(pp)] == \
            [(st, 2 * pp - 1 - st) for st in range(pp)]
        assert all(s.place(s.virtual(st, c)) == (st, c) for st in range(pp) for c in (0, 1))
        rows = s.timeline()
        makespan = max(row[-1][1] for row in rows)
        assert makespan == 6 * m + pp - 1
        assert all(makespan - sum(end - start for start, end, _ in row) == pp - 1
                   for row in rows)
        one = build_schedule("1f1b", pp, 1, m)
        assert max(s.peak_in_flight()) == 2 * max(one.peak_in_flight())  # chunks = 2 per stage
        h1 = build_schedule("zb-h1", pp, 1, m)
        assert s.bubble_fraction() < h1.bubble_fraction() < one.bubble_fraction()
    turn = build_schedule("zb-v", 2, 2, 2).stages[1]  # stage 1 runs virtual stages 1 and 2
    assert not any(a.kind == "SEND_F" and a.chunk == 0 for a in turn)
    assert not any(a.kind == "SEND_B" and a.chunk == 1 for a in turn)


def test_zero_bubble_v_order_is_the_shortest_candidate_one_more_admitted_only_if_clearly():
    """zb-v's order is the shortest of list-scheduled candidates. A light first chunk and a
    heavy last one (the pipeline benchmark's split 0.5 + 2.5 + 2 + 3 layers with the head,
    per-action ms): with pp micro-batches admitted, both stages wait once a round for the trip
    round the V; one more fills the wait, 4% shorter, for 2 pp + 2 chunk activations instead
    of 2 pp. With equal chunks and m a multiple of pp nothing is gained and the order keeps
    1F1B's bound; with other m one more reaches 6m + p - 1."""
    costs = [2.5, 15.9, 12.1, 26.4]
    (_, tight), (_, loose) = list_schedule(2, 8, costs), list_schedule(2, 8, costs, 3)
    assert loose < tight * (1 - WORTH_ONE_MORE)
    chosen = build_schedule("zb-v", 2, 2, 8, costs=costs)
    rows = chosen.timeline(action_cost=lambda st, a: costs[chosen.virtual(st, a.chunk)])
    assert max(row[-1][1] for row in rows) == pytest.approx(loose)
    assert chosen.peak_in_flight() == [6, 6]
    for pp, m in ((2, 4), (3, 6), (4, 8), (2, 7), (3, 10), (4, 13)):
        equal = build_schedule("zb-v", pp, 2, m, costs=[1.0] * (2 * pp))
        assert max(row[-1][1] for row in equal.timeline()) == 6 * m + pp - 1
        if m % pp == 0:
            assert max(equal.peak_in_flight()) == 2 * pp
    assert list_schedule(2, 7)[1] > 6 * 7 + 1  # pp admitted: a little more
    # equal chunks but a heavier head: the greedy order made for the costs loses to the
    # regular one (127.5 against 123 units), which the schedule takes
    head = [1.0] * 7 + [1.5]
    own, regular = list_schedule(4, 16, head)[1], replay(4, list_schedule(4, 16)[0], head)
    assert (own, regular) == pytest.approx((127.5, 123.0))
    chosen = build_schedule("zb-v", 4, 2, 16, costs=head)
    assert max(row[-1][1] for row in chosen.timeline(
        action_cost=lambda st, a: head[chosen.virtual(st, a.chunk)])) <= regular + 1e-9


def test_zero_bubble_v_orders_for_each_kinds_cost():
    """Costs may come per kind, (F, B, W) for each virtual stage, as the cost model has them:
    with a W under a third of B, an order made for the three alike holds W back for gaps it
    cannot fill; made for the triples it is 19% shorter (73.6 against 90.5 units, pp=3, m=12,
    the head's chunk 1.5 times the others)."""
    kinds = [(1.0, 1.1, 0.3)] * 5 + [(1.5, 1.65, 0.45)]
    alike = [sum(k) / 3 for k in kinds]
    by_kind = build_schedule("zb-v", 3, 2, 12, costs=kinds)
    assert by_kind.costs == tuple(kinds)
    price = {"F": 0, "B": 1, "W": 2}

    def makespan(schedule):
        rows = schedule.timeline(action_cost=lambda st, a: kinds[schedule.virtual(
            st, a.chunk)][price[a.kind]])
        return max(row[-1][1] for row in rows)

    assert makespan(by_kind) == pytest.approx(73.6)
    assert makespan(build_schedule("zb-v", 3, 2, 12, costs=alike)) == pytest.approx(90.5)


# ------------------------------------------------------------------ the order from measured costs


def _measured_order_runs(rank: int, world_size: int, cache_dir: str, root: str) -> dict:
    """One zb-v run (pp=2, tied embeddings on stage 0's two chunks) three ways: in the plan's
    order; with ``parallel.zb_v_measured_order=2`` (whichever order its timings give); and
    re-ordered before step 1 for fixed costs whose W is a fifth of F and B."""
    layout = ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.schedule=zb-v",
              "--model.num_layers=4", "--train.micro_batch=1"]
    out: dict = {}
    for name, after in (("plan", 0), ("measured", 2), ("fixed", 0), ("plan untied", 0),
                        ("fixed untied", 0)):
        lines: list[str] = []
        tied = [] if "untied" in name else ["--model.tie_embeddings=true"]
        overrides = test_overrides(cache_dir, f"{root}/{name}", steps=4) + layout + tied + [
            f"--parallel.zb_v_measured_order={after}"]
        trainer = Trainer(load_config(overrides=overrides),
                          ParallelMesh(MeshLayout(world_size, pp=2), rank), log=lines.append)
        planned = trainer.pipeline.schedule
        if name.startswith("fixed"):
            costs = [(1.0, 1.0, 0.2), (1.0, 1.0, 0.2), (2.0, 2.0, 0.4), (1.5, 1.5, 0.3)]
            lines.append(MeasuredOrder(2, None).reorder(trainer.pipeline, costs, "fixed costs"))
        result = trainer.run()
        ran = trainer.pipeline.schedule
        out[name] = {"loss": result.losses, "grad_norm": result.grad_norms,
                     "lines": [line for line in lines
                               if "zb-v re-ordered" in line or "zb-v keeps" in line],
                     "costs": ran.costs, "changed": ran.stages != planned.stages,
                     "chunk_orders": [[[(a.kind, a.microbatch) for a in
                                        ran.compute_actions(s) if a.chunk == c]
                                       for c in (0, 1)] for s in range(2)]}
    return out


@pytest.mark.slow
def test_zb_v_reordered_for_measured_costs_keeps_the_losses(data_cache, tmp_path):
    """``parallel.zb_v_measured_order=2``: after step 2 every rank runs one order, made for
    the same measured (F, B, W) seconds, or keeps the plan's where that is as short. Re-ordered
    (here for fixed costs, so surely), the losses and grad norms stay those of the plan's order:
    each chunk's B and W still go in micro-batch order, and only the tied weight's two chunks
    may add in another order (1e-6). Without a tied weight every gradient adds in the plan's
    order: the same bits, so a layout re-ordered for timings has one outcome whatever order
    they give (the pp=4 parity layout's)."""
    ranks = run_distributed(_measured_order_runs, 2, data_cache, str(tmp_path), timeout=300)
    plan, measured, fixed = (ranks[0][name] for name in ("plan", "measured", "fixed"))
    assert plan["lines"] == [] and not plan["changed"]
    assert not isinstance(plan["costs"][0], tuple)  # the plan's: one FLOP figure per chunk
    assert len(measured["lines"]) == 1 and "measured over 1 step" in measured["lines"][0]
    assert ranks[1]["measured"]["lines"] == []  # only rank 0 logs
    assert measured["costs"] == ranks[1]["measured"]["costs"]  # one order on every rank
    if "re-ordered" in measured["lines"][0]:
        assert measured["changed"]
        assert all(len(c) == 3 and min(c) > 0 for c in measured["costs"])
    else:
        assert "keeps its order" in measured["lines"][0] and not measured["changed"]
    assert fixed["changed"] and "re-ordered for fixed costs" in fixed["lines"][0]
    untied = ranks[0]["fixed untied"]
    assert untied["changed"] and "re-ordered for fixed costs" in untied["lines"][0]
    assert untied["chunk_orders"] == fixed["chunk_orders"]
    for key in ("loss", "grad_norm"):
        assert untied[key] == ranks[0]["plan untied"][key]  # exactly
    for run in (measured, fixed):
        for stage in run["chunk_orders"]:
            for chunk in stage:
                for kind in "FBW":
                    assert [m for k, m in chunk if k == kind] == list(range(8))
        for key in ("loss", "grad_norm"):
            assert run[key] == pytest.approx(plan[key], rel=1e-6)


def test_zb_v_measured_order_needs_two_steps_and_other_schedules_ignore_it(tmp_path):
    base = test_overrides(str(tmp_path), str(tmp_path)) + ["--parallel.pp=2",
                                                           "--model.num_layers=4"]
    check_run(load_config(overrides=base + ["--parallel.zb_v_measured_order=4"]), 2)  # 1f1b
    for steps in (1, -1):
        with pytest.raises(MeshtronError, match=re.escape(
                f"parallel.zb_v_measured_order={steps} must be 0 (off) or at least 2 steps "
                "(the first step is not timed)")) as err:
            check_run(load_config(overrides=base + [
                "--parallel.vpp=2", "--parallel.schedule=zb-v",
                f"--parallel.zb_v_measured_order={steps}"]), 2)
        assert "\n" not in str(err.value)
