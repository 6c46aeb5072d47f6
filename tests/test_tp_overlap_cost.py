"""The cost model prices parallel.tp_comm_overlap: the fill-and-drain formula on a GPU, where
the chunked collectives hide behind the products, and k latencies on CPU ranks, where nothing
hides."""

from __future__ import annotations

import dataclasses

import pytest

from meshtron.config import load_config
from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.comms import collective_seconds, layout_groups
from meshtron.costmodel.estimate import Estimator, Problem
from meshtron.costmodel.layer_comms import layer_communication, overlapped_seconds
from meshtron.costmodel.memory_model import with_vocab
from meshtron.costmodel.problem import Cluster, problem_of
from meshtron.costmodel.profiles import load_profile
from meshtron.costmodel.workload import layer_work

TP8_SP = Candidate(8, 1, 1, 1, "1f1b", 1, None, 1, 0, True, 2, "none")


def llama(chunks: int, profile: str = "h100-sxm") -> Problem:
    cfg = load_config(overrides=["--model.preset=llama3-8b"]).model
    return Problem(with_vocab(cfg, 128256), 4096, 16, load_profile(profile), 8,
                   tp_comm_chunks=chunks)


@pytest.mark.parametrize("gemm", [1e-6, 1e-2])  # communication-bound, then compute-bound
def test_an_overlapped_collective_exposes_the_pipelines_fill_and_drain(gemm):
    problem = llama(4)
    group = layout_groups(TP8_SP, 8).tp
    piece = collective_seconds(problem.profile, "all_gather", group, 64e6 / 4)
    exposed = overlapped_seconds(problem, "all_gather", group, 64e6, gemm, overlaps=True)
    assert exposed == pytest.approx(piece + 3 * max(piece, gemm / 4) + gemm / 4 - gemm)
    assert exposed == pytest.approx(piece if gemm / 4 > piece else 4 * piece - 3 * gemm / 4)
    assert overlapped_seconds(problem, "all_gather", group, 64e6, gemm, overlaps=False) \
        == pytest.approx(4 * piece)


def test_a_dense_layer_hides_its_four_sp_collectives_behind_their_products():
    """Attention: gather before q/kv, reduce-scatter after the output projection; MLP: gather
    before gate_up (2/3 of its product), reduce-scatter after down (1/3)."""
    whole, overlapped = llama(0), llama(2)
    estimator = Estimator(overlapped)
    work = layer_work(overlapped.model, 0, overlapped.seq_len, TP8_SP, overlapped.element_size)
    gemms = estimator._gemm_seconds(work, estimator.rate_scale(TP8_SP))
    group = layout_groups(TP8_SP, 8).tp
    activation = 2 * 4096 * overlapped.model.hidden_size * overlapped.element_size
    expected = sum(overlapped_seconds(overlapped, kind, group, activation, gemm, True)
                   for kind, gemm in (("all_gather", gemms[0]), ("reduce_scatter", gemms[1]),
                                      ("all_gather", 2 / 3 * gemms[2]),
                                      ("reduce_scatter", 1 / 3 * gemms[2])))
    forward, backward = layer_communication(overlapped, 0, TP8_SP, 0.0, True, gemms)
    assert forward == backward == pytest.approx(expected)
    plain = layer_communication(whole, 0, TP8_SP, 0.0, True, gemms)[0]
    assert forward < plain
    # the step is faster by the layers' hidden communication (forward and backward)
    saved = Estimator(whole).estimate(TP8_SP).step_time_s \
        - estimator.estimate(TP8_SP).step_time_s
    assert saved > 0


def test_on_cpu_ranks_more_pieces_only_add_latency():
    cpu = load_config(overrides=["--model.preset=tiny", "--model.vocab_size=256"]).model
    host = load_profile("h100-sxm")
    host = dataclasses.replace(host, compute_units=2)  # a CPU host: nothing overlaps
    candidate = dataclasses.replace(TP8_SP, tp=2)
    costs = []
    for chunks in (0, 1, 4):
        problem = Problem(cpu, 64, 4, host, 2, tp_comm_chunks=chunks)
        estimator = Estimator(problem)
        assert not estimator.overlaps
        costs.append(estimator.layer_seconds(0, candidate)[3])
    assert costs[0] == pytest.approx(costs[1]) and costs[2] > costs[1]


def test_the_plan_prices_overlap_only_when_it_is_on():
    cluster = Cluster(load_profile("h100-sxm"), 8)
    base = ["--model.preset=tiny", "--model.vocab_size=256", "--parallel.tp_comm_chunks=4"]
    assert problem_of(load_config(overrides=base), cluster).tp_comm_chunks == 0
    on = load_config(overrides=[*base, "--parallel.tp_comm_overlap=true"])
    assert problem_of(on, cluster).tp_comm_chunks == 4
