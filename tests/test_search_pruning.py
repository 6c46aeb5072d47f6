"""The layout search's speed-ups change no answer: the pruned search (layouts dropped by their
optimizer state before enumeration, micro-batch sizes past the first that overflows) ranks the
same plans with the same figures and counts as the search that prices every layout's memory,
and the estimator's caches (chunk costs per partition, schedules, the last memory, the plan
check per layout) give what a fresh estimator gives for each plan."""

from __future__ import annotations

import pytest

from meshtron.config import load_config
from meshtron.costmodel.estimate import Estimator
from meshtron.costmodel.problem import Cluster, problem_of
from meshtron.costmodel.profiles import load_profile
from meshtron.costmodel.search import Pins, plan_error, search

CASES = {  # preset, GPU, GPUs, global batch, sequence length: dense, MoE, deep pipelines
    "llama3-8b": ("llama3-8b", "h100-sxm", 16, 64, 4096),
    "mixtral-8x7b": ("mixtral-8x7b", "h100-sxm", 16, 32, 4096),
    "gpt3-175b": ("gpt3-175b", "a100-80gb", 64, 64, 2048),
}


def planned(name: str):
    preset, gpu, gpus, batch, seq = CASES[name]
    cfg = load_config(overrides=[f"--model.preset={preset}", f"--train.global_batch={batch}",
                                 f"--train.seq_len={seq}", "--precision.dtype=bf16"])
    return cfg, problem_of(cfg, Cluster(load_profile(gpu), gpus))


def signature(result) -> tuple:
    return (result.considered, result.fitting,
            [(e.candidate, e.step_time_s, e.memory.peak, e.fits) for e in result.ranked])


@pytest.mark.parametrize("name", [
    "llama3-8b", "mixtral-8x7b",
    pytest.param("gpt3-175b", marks=pytest.mark.slow)])  # 96 layers' pipelines: 10-15 s
def test_pruned_search_ranks_what_the_full_search_ranks(name):
    cfg, problem = planned(name)
    pruned = search(problem, Pins(), cfg, simulate=12)
    full = search(problem, Pins(), cfg, simulate=12, prune=False)
    assert pruned.ranked and pruned.ranked[0].fits
    assert signature(pruned) == signature(full)


def test_cached_figures_equal_a_fresh_estimators_and_the_plan_checks():
    cfg, problem = planned("mixtral-8x7b")
    result = search(problem, Pins(), cfg, simulate=12)
    for e in result.ranked[:6]:
        fresh = Estimator(problem).estimate(e.candidate)
        assert (fresh.step_time_s, fresh.memory.peak) == (e.step_time_s, e.memory.peak)
        assert plan_error(cfg, e.candidate, problem.gpus) is None


def test_shared_prices_equal_a_fresh_estimators_for_every_kind_of_candidate():
    """The first pass shares prices between candidates (peaks over ZeRO stages and expert
    splits, stage totals over schedules, groups over micro-batch sizes and recompute modes):
    a candidate priced after all the others gets what a fresh estimator gives it, whatever
    its recompute mode, ZeRO stage, schedule or expert split."""
    from meshtron.costmodel.search import candidates

    _, problem = planned("mixtral-8x7b")
    warm = Estimator(problem)
    every = list(candidates(problem, Pins()))
    for c in every:
        warm.peak_bytes(c)
        warm.step_parts(c, simulate=False)
    sample = every[::max(1, len(every) // 90) | 1][:100] + every[1::97][:40]  # odd strides cross
    # the recompute modes' cycle of 3 and the ZeRO stages'
    assert {c.recompute for c in sample} == {"none", "selective", "full"}
    assert {c.zero for c in sample} == {0, 1, 2, 3} and {c.etp for c in sample} == {None, 1}
    assert {c.schedule for c in sample} >= {"1f1b", "zb-h1", "interleaved"}
    for c in sample:
        fresh = Estimator(problem)
        assert warm.peak_bytes(c) == fresh.peak_bytes(c) == fresh.memory(c).peak, c
        assert warm.step_parts(c, simulate=False) == fresh.step_parts(c, simulate=False), c
