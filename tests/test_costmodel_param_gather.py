"""The cost model prices ZeRO-3's low-precision parameter gather (``precision.fp8_param_gather``)
as the product sends it (docs/precision.md, "FP8 parameter all-gather (ZeRO-3)"): the FP8
blocks' linear weights at one byte an element, the NVFP4 blocks' at half a byte, the rest in
the dtype; plus one all-reduce of an fp32 amax per FP8 weight and per NVFP4 16 x 16 tile."""

from __future__ import annotations

import pytest

from meshtron.config import load_config
from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.comms import collective_seconds, layout_groups
from meshtron.costmodel.estimate import Estimator
from meshtron.costmodel.memory_model import rank_params
from meshtron.costmodel.problem import Cluster, problem_of
from meshtron.costmodel.profiles import load_profile

LAYOUT = Candidate(tp=2, cp=1, pp=1, vpp=1, schedule="1f1b", ep=1, etp=None, dp=4, zero=3,
                   sp=True, micro_batch=1, recompute="none")
# llama3-8b cut to 4 blocks: per block, q/kv/proj and gate_up/down weights
H, KV, FFN = 4096, 8 * 128, 14336
BLOCK = H * (H + 2 * KV) + H * H + 3 * H * FFN


def priced(*precision: str):
    """(dense group's (once-a-step, ZeRO-3 gather) seconds, bf16 dense bytes per rank, the
    profile and the dense group) of LAYOUT on 8 H100s."""
    cfg = load_config(overrides=["--model.preset=llama3-8b", "--model.num_layers=4",
                                 "--train.global_batch=8", "--train.seq_len=1024",
                                 "--precision.dtype=bf16", *precision])
    problem = problem_of(cfg, Cluster(load_profile("h100-sxm"), 8))
    estimator = Estimator(problem)
    (_, after, gather), _ = estimator.data_parallel_costs(LAYOUT, 0)[0]
    dense = rank_params(estimator.stage_params(LAYOUT, 0), LAYOUT)[0]
    group = layout_groups(LAYOUT, problem.profile.gpus_per_node).dp
    return (after, gather), dense * 2, problem.profile, group


def test_the_zero3_gather_moves_fp8_and_nvfp4_weights_in_their_own_bytes():
    (after, bf16), dense_bytes, profile, group = priced("--precision.fp8=tensorwise")
    assert after == 0.0
    assert bf16 == pytest.approx(collective_seconds(profile, "all_gather", group, dense_bytes),
                                 rel=1e-12)
    # FP8 everywhere but block 0: blocks 1-3's linear weights (this tp rank's half) at 1 byte
    (after, fp8), _, _, _ = priced("--precision.fp8=tensorwise", "--precision.keep_layers=[0]",
                                   "--precision.fp8_param_gather=true")
    low = 3 * BLOCK / 2
    fp8_bytes = dense_bytes - low * 2 + low * 1
    assert fp8 == pytest.approx(collective_seconds(profile, "all_gather", group, fp8_bytes),
                                rel=1e-12)
    assert after == pytest.approx(collective_seconds(profile, "all_reduce", group, 4 * 3 * 5),
                                  rel=1e-12)  # one fp32 amax per FP8 weight, 5 a block
    # against bf16: the gather is short by exactly one byte per FP8 element (the bandwidth
    # term of a ring all-gather is linear in its bytes)
    saved = collective_seconds(profile, "all_gather", group, 2 * low) \
        - collective_seconds(profile, "all_gather", group, low)
    assert bf16 - fp8 == pytest.approx(saved, rel=1e-9) and saved > 0.15 * bf16
    # block 1 in NVFP4 (half a byte), blocks 2-3 in FP8, block 0 kept
    (after, fp4), _, _, _ = priced("--precision.fp8=tensorwise", "--precision.fp4=nvfp4",
                                   "--precision.fp4_layers=[1]", "--precision.keep_layers=[0]",
                                   "--precision.fp8_param_gather=true")
    half = BLOCK / 2
    fp4_bytes = dense_bytes - 3 * half * 2 + half * 0.5 + 2 * half * 1
    assert fp4 == pytest.approx(collective_seconds(profile, "all_gather", group, fp4_bytes),
                                rel=1e-12)
    amaxes = 4 * (2 * 5 + half / 256)
    assert after == pytest.approx(collective_seconds(profile, "all_reduce", group, amaxes),
                                  rel=1e-12)
