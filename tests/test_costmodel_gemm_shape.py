"""A GEMM's efficiency by its shape on a GPU profile (meshtron/costmodel/gemm_shape.py): tile
and wave quantization on the SM count, the epilogue amortised over k, the backward's
transposed products, a CPU profile's FLOPs-only curve, and the calibration that divides the
shape out before it fits the curve."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshtron.costmodel import gemm_shape
from meshtron.costmodel.profiles import load_profile, profile_to_dict, save_profile
from meshtron.errors import MeshtronError


def test_waves_of_the_sm_count_and_the_best_tile():
    # the A100 1.7B run's output projection: 2048 x 2304 outputs on 108 SMs. 256x128 tiles
    # (or 128x256): 144 tiles, two waves of 108, 2/3 full; 128x128: 288 tiles, 3 waves
    assert gemm_shape.quantization(2048, 2304, 108, 256, 128) == pytest.approx(288 / 324)
    # the guide's example: 1792 x 1792 in 256x128 tiles is 98 tiles, one wave on 10 idle SMs
    assert gemm_shape.quantization(1792, 1792, 108, 256, 128) \
        == pytest.approx(1792 * 1792 / (108 * 256 * 128))
    assert gemm_shape.quantization(128 * 132, 256, 132, 128, 256) == 1.0  # one full wave


def test_the_epilogue_is_the_output_bytes_at_the_sms_share_of_the_bandwidth():
    h100 = load_profile("h100-sxm")
    steps = gemm_shape.epilogue_steps(h100.peak("bf16"), h100.memory_bandwidth, 64)
    assert steps == pytest.approx(2 * 989e12 / (2 * 3.35e12 * 64))  # 4.6 k steps
    assert gemm_shape.k_efficiency(2048, 64, steps) == pytest.approx(32 / (32 + steps))
    # the same FLOPs (the same square GEMM to compare with): k = 2,048 loses more than 8,192
    short = h100.gemm_shape_fraction(16384, 8192, 2048, "bf16")
    long = h100.gemm_shape_fraction(16384, 2048, 8192, "bf16")
    waves = (gemm_shape.quantization(16384, 8192, 132, 128, 256)
             / gemm_shape.quantization(16384, 2048, 132, 128, 256))
    assert short / long == pytest.approx(waves * (32 / (32 + steps)) / (128 / (128 + steps)),
                                         rel=1e-9)
    # FP8 doubles the peak, not the output's bytes: twice the epilogue in k steps
    assert gemm_shape.epilogue_steps(h100.peak("fp8"), h100.memory_bandwidth, 64) \
        == pytest.approx(2 * steps, rel=1e-3)


def test_the_backward_prices_the_transposed_products_on_a_gpu_only():
    from meshtron.costmodel.estimate import Estimator
    from meshtron.costmodel.published import load_published_runs
    from meshtron.costmodel.workload import layer_work

    run = next(r for r in load_published_runs() if r.name == "megatron-h100-1.7b-48gpu")
    pr = run.problem
    work = layer_work(pr.model, 0, pr.seq_len, run.candidate, pr.element_size)
    assert sum(2 * m * n * k for g in work.gemms for m, n, k in g.shapes) \
        == pytest.approx(work.gemm_flops)
    estimator = Estimator(pr, run.software, run.pp_layers)
    forward, dgrad, wgrad = estimator.gemm_directions(work, 1.0)
    # the layer's backward is its products' transposes (tp 1, no recompute: no communication)
    _, core, memory = estimator._work_seconds(work, 1.0)
    layer = estimator.layer_seconds(0, run.candidate)
    assert layer[1:] == pytest.approx((dgrad + 2.5 * core + 2 * memory, wgrad, 0.0), rel=1e-12)
    # k = 2,048 forward products; their input gradients run over n (6,144 and 8,192) and
    # their weight gradients over the 16,384 tokens: the backward is faster per FLOP
    assert forward > dgrad > 0 and forward > wgrad > 0
    fc1 = (16384, 8192, 2048)  # the MLP's first product (gate and up fused), this rank's
    assert fc1 in work.gemms[2].shapes
    flat = dataclasses.replace(pr.profile, sm_count=None)
    cpu = Estimator(dataclasses.replace(pr, profile=flat))
    same = cpu.gemm_directions(work, 1.0)
    assert same[0] == same[1] == same[2]  # no shape model: the FLOPs curve, all alike
    p = cpu.problem.profile
    assert same[0] == pytest.approx(sum(g.count * g.flops / (p.peak("bf16") * p.gemm_fraction(
        g.flops)) for g in work.gemms), rel=1e-12)


def test_a_profile_keeps_its_sm_count_and_tile_and_refuses_bad_ones(tmp_path):
    h100 = load_profile("h100-sxm")
    assert h100.sm_count == 132 and h100.gemm_tile == (128, 256, 64)
    assert load_profile("a100-80gb").sm_count == 108
    loaded = load_profile(str(save_profile(h100, tmp_path / "h100.json")))
    assert loaded == h100
    from meshtron.tune.calibrate import profile_summary

    assert "132 SMs, 128x256 tiles in k steps of 64" in profile_summary(h100, tmp_path)
    assert "SMs" not in profile_summary(dataclasses.replace(h100, sm_count=None), tmp_path)
    for field, value, words in (("sm_count", 0, "'sm_count'"), ("sm_count", 1.5, "'sm_count'"),
                                ("gemm_tile", [128, 256], "'gemm_tile'"),
                                ("gemm_tile", [128, 0, 64], "'gemm_tile'")):
        raw = {**profile_to_dict(h100), field: value}
        path = tmp_path / f"{field}.json"
        path.write_text(json.dumps(raw))
        with pytest.raises(MeshtronError, match=words) as err:
            load_profile(str(path))
        assert "\n" not in str(err.value)


def test_calibration_divides_each_shapes_factor_out_of_the_curve():
    from meshtron.tune import calibrate

    rates = [(1e9, 50.0), (1e10, 80.0)]
    assert calibrate.efficiency_curve(rates, 100.0, [0.5, 0.8]) == ((1e9, 1.0), (1e10, 1.0))
    assert calibrate.efficiency_curve(rates, 100.0, [1.0, 1.0]) \
        == calibrate.efficiency_curve(rates, 100.0) == ((1e9, 0.5), (1e10, 0.8))
