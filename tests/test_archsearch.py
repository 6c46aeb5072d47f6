"""``meshtron archsearch``: the scaling-law fit on synthetic data with known coefficients, the
shape grid and its pruning, what a budget buys with and without a cluster, the front, one run
of the command with real (tiny) proxy runs, and every bad input as one line."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from meshtron.archsearch import proxy_runs
from meshtron.archsearch.report import best, pareto_front
from meshtron.archsearch.scaling_law import CHINCHILLA, Point, ScalingLaw, fit_law, parse_law
from meshtron.archsearch.shape_cost import Priced, Pricer, budget_of
from meshtron.archsearch.shapes import (
    Shape,
    ShapeSpace,
    Sizes,
    default_grid,
    enumerate_shapes,
    rounded_ffn,
    shape_config,
    shape_pins_of,
    sizes_of,
)
from meshtron.cli import main
from meshtron.config import load_config
from meshtron.costmodel.memory_model import with_vocab
from meshtron.errors import MeshtronError
from meshtron.models.flops import training_flops_per_token
from meshtron.training.metrics import read_metrics
from meshtron.tune.tune_command import cluster_of

TRUE = ScalingLaw(E=1.8, A=400.0, alpha=0.34, B=410.0, beta=0.28)
SIZES = (1e6, 3e6, 1e7, 3e7, 1e8)
TOKENS = (1e8, 3e8, 1e9, 3e9)


def synthetic(law: ScalingLaw = TRUE) -> list[Point]:
    return [Point(n, d, law.loss(n, d), run=f"{n:g}") for n in SIZES for d in TOKENS]


def assert_law_close(got: ScalingLaw, want: ScalingLaw, rel: float) -> None:
    for key, value in want.as_dict().items():
        assert getattr(got, key) == pytest.approx(value, rel=rel), (key, got)


# ----------------------------------------------------------------------------- the fit


def test_fit_recovers_known_coefficients():
    fit = fit_law(synthetic())
    assert_law_close(fit.law, TRUE, 2e-3)
    assert fit.rms < 1e-4 and not fit.warnings
    assert set(fit.holdout) == {f"{n:g}" for n in SIZES}
    assert max(abs(e) for e in fit.holdout.values()) < 1e-3


def test_fit_recovers_another_law_from_few_points_per_run():
    law = ScalingLaw(E=0.5, A=30.0, alpha=0.6, B=2000.0, beta=0.45)
    points = [Point(n, d, law.loss(n, d), str(n)) for n in (1e4, 1e5, 1e6)
              for d in (1e6, 3e6, 1e7)]
    assert_law_close(fit_law(points, holdout=False).law, law, 5e-3)


def test_fit_is_robust_to_noise_and_an_outlier():
    rng = random.Random(0)
    points = [Point(p.n, p.d, p.loss * (1 + rng.gauss(0, 0.002)), p.run) for p in synthetic()]
    points[5] = Point(points[5].n, points[5].d, points[5].loss * 1.3, points[5].run)
    law = fit_law(points, holdout=False).law
    # what the choice depends on: predictions at a budget beyond the data stay within 1%
    for n in (3e8, 1e9):
        assert law.loss(n, 2e10) == pytest.approx(TRUE.loss(n, 2e10), rel=0.01)


def test_fit_refuses_too_little_data():
    with pytest.raises(MeshtronError, match="at least 5 losses"):
        fit_law(synthetic()[:4])
    with pytest.raises(MeshtronError, match="2 model sizes"):
        fit_law([Point(1e6, d, TRUE.loss(1e6, d)) for d in (1e8, 2e8, 3e8, 4e8, 5e8)])
    bad = synthetic()
    bad[0] = Point(bad[0].n, bad[0].d, float("nan"), "x")
    with pytest.raises(MeshtronError, match="cannot be fitted"):
        fit_law(bad)


def test_a_flat_law_is_said():
    points = [Point(n, d, 3.0 + 50 / d ** 0.3, str(n)) for n in SIZES for d in TOKENS]
    fit = fit_law(points, holdout=False)
    assert pytest.approx(0, abs=1e-6) == fit.law.A
    assert any("no effect of model size" in w for w in fit.warnings)


def test_parse_law(tmp_path):
    assert parse_law("chinchilla") == CHINCHILLA
    assert parse_law("1,2,0.3,4,0.2") == ScalingLaw(1, 2, 0.3, 4, 0.2)
    saved = tmp_path / "arch.json"
    saved.write_text(json.dumps({"fit": {"law": TRUE.as_dict()}}))
    assert parse_law(str(saved)) == TRUE
    for bad in ("1,2,3", "1,2,x,4,5", "-1,2,0.3,4,0.2", str(tmp_path / "none.json")):
        with pytest.raises(MeshtronError, match="--law"):
            parse_law(bad)


# ----------------------------------------------------------------------------- shapes


def test_grid_enumeration_divides_and_pins_stay_fixed():
    space = ShapeSpace(layers=(2, 4), widths=(64, 96, 128), head_dims=(16, 32), kv_groups=(1, 2),
                       ffn_ratios=(4.0,))
    shapes = list(enumerate_shapes(space))
    for s in shapes:
        assert s.hidden_size % s.num_heads == 0 and s.num_heads % s.num_kv_heads == 0
        assert s.hidden_size // s.num_heads in (16, 32)
        assert s.ffn_hidden_size == 4 * s.hidden_size
    # 96 / 32 = 3 heads: kv groups of 2 do not divide them
    assert Shape(2, 96, 3, 3, 384) in shapes and not any(
        s.hidden_size == 96 and s.num_heads == 3 and s.num_kv_heads != 3 for s in shapes)
    assert len(shapes) == len(set(shapes)) == 2 * (4 + 3 + 4)
    pinned = ShapeSpace(layers=(2, 4), widths=(64, 128), head_dims=(16,),
                        pins=shape_pins_of({"model.num_layers": 3, "model.num_kv_heads": 2,
                                      "model.preset": "tiny"}))
    assert {s.num_layers for s in enumerate_shapes(pinned)} == {3}
    assert {s.num_kv_heads for s in enumerate_shapes(pinned)} == {2}


def test_ffn_rounding_and_moe_variants():
    assert rounded_ffn(8 / 3, 4096) == 11008  # Llama-2 7B's
    assert rounded_ffn(3.0, 96) == 288
    space = ShapeSpace(layers=(2,), widths=(64,), experts=(0, 4), top_k=(1, 2, 8),
                       expert_ratio=1.0)
    shapes = list(enumerate_shapes(space))
    assert {(s.num_experts, s.top_k) for s in shapes} == {(0, 0), (4, 1), (4, 2)}
    assert all(s.expert_ffn_size == 64 for s in shapes if s.num_experts)


def test_moe_law_size_is_between_active_and_total():
    cfg = load_config(overrides=["--model.preset=tiny-moe"])
    m = with_vocab(cfg.model, 512)
    sizes = sizes_of(m)
    assert sizes.active < sizes.law < sizes.total
    assert sizes.law == pytest.approx(math.sqrt(sizes.active * sizes.total))
    dense = sizes_of(with_vocab(load_config(overrides=["--model.preset=tiny"]).model, 512))
    assert dense.law == dense.total == dense.active


def test_default_grid_is_centred_on_the_budget():
    m = with_vocab(load_config().model, 2048)
    for flops in (1e13, 1e21):
        layers, widths = default_grid(flops, m, 256)
        ratios = []
        for depth in layers:
            for width in widths:
                shape = Shape(depth, width, width // 32, width // 32, 3 * width)
                model = with_vocab(shape_config(load_config(), shape).model, 2048)
                ratios.append(flops / training_flops_per_token(model, 256)
                              / sizes_of(model).total)
        assert min(ratios) < 20 < max(ratios)  # Chinchilla's tokens per parameter inside
    small, large = default_grid(1e13, m, 256), default_grid(1e21, m, 256)
    assert max(small[1]) < min(large[1])
    assert default_grid(1.0, m, 256) == ((2,), (32, 48))  # nothing trains: the smallest


# ----------------------------------------------------------------------------- budget -> tokens

TINY = ["--model.preset=tiny", "--data.vocab_size=512", "--train.seq_len=32",
        "--train.global_batch=8", "--train.warmup_steps=2"]
SHAPE = Shape(2, 64, 4, 4, 256)


def test_without_a_cluster_the_flops_buy_the_tokens():
    cfg = load_config(overrides=TINY)
    pricer = Pricer(cfg, budget_of(1e12, None, None, "fp32"), 1e9, 1)
    p = pricer.local(SHAPE)
    model = with_vocab(pricer.config(SHAPE).model, 512)
    assert p.flops_per_token == training_flops_per_token(model, 32)
    assert p.tokens == pytest.approx(1e12 / p.flops_per_token)
    assert p.steps == int(p.tokens // (8 * 32))
    # fp32 AdamW: parameters, gradients and two moments, 16 bytes each, plus activations
    assert 16 * p.params < p.memory_bytes < 16 * p.params + 64 * 2**20 and p.fits
    assert not Pricer(cfg, budget_of(1e12, None, None, "fp32"), 1e5, 1).local(SHAPE).fits


def test_on_a_cluster_the_time_buys_the_tokens_of_the_best_layout():
    cfg = load_config(overrides=[*TINY, "--precision.dtype=bf16", "--train.global_batch=64"])
    cluster = cluster_of({"gpu": "h100-sxm", "gpus": 8})
    budget = budget_of(None, 2.0, cluster, "bf16")
    assert budget.seconds == pytest.approx(2.0 * 3600 / 8)
    assert budget.flops == pytest.approx(budget.seconds * 8 * cluster.profile.peak("bf16"))
    by_flops = budget_of(budget.flops, None, cluster, "bf16")
    assert by_flops.seconds == pytest.approx(budget.seconds)
    pricer = Pricer(cfg, budget, None, 1)
    bound, exact = pricer.bound(SHAPE), pricer.searched(SHAPE)
    assert exact.estimate is not None and exact.fits
    assert exact.tokens == pytest.approx(budget.seconds * exact.estimate.tokens_per_s)
    assert exact.tokens <= bound.tokens and exact.memory_bytes >= bound.memory_bytes
    # tokens per FLOP of budget is the MFU: a faster shape on the cluster sees more tokens
    assert exact.tokens * exact.flops_per_token / budget.flops == pytest.approx(
        exact.estimate.mfu, rel=1e-6)


def test_budget_flags_are_checked():
    cluster = cluster_of({"gpu": "h100-sxm", "gpus": 8})
    for flops, hours, where, words in ((None, None, None, "needs a budget"),
                                       (1e12, 1.0, cluster, "only one of"),
                                       (None, 1.0, None, "needs a cluster"),
                                       (-1.0, None, None, "positive"),
                                       (math.inf, None, None, "positive")):
        with pytest.raises(MeshtronError, match=words):
            budget_of(flops, hours, where, "bf16")


# ----------------------------------------------------------------------------- the front


def priced(flops_per_token: float, loss: float) -> Priced:
    return Priced(Shape(2, int(flops_per_token), 1, 1, 4), Sizes(1, 1), 1, flops_per_token,
                  1.0, 1, 0.0, True, loss=loss)


def test_front_is_the_shapes_no_cheaper_one_beats():
    points = [priced(1, 5.0), priced(2, 4.0), priced(3, 4.5), priced(4, 3.5), priced(5, 3.5),
              priced(6, 3.6), priced(7, 3.0)]
    front = pareto_front(points)
    assert [p.flops_per_token for p in front] == [1, 2, 4, 7]
    assert best(points) is front[-1] is points[-1]
    assert best([priced(2, 3.0), priced(1, 3.0)]).flops_per_token == 1


# ----------------------------------------------------------------------------- the command


def archsearch(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["archsearch", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def tiny_args(data_cache: str, *more: str) -> list[str]:
    return [*TINY, "--model.max_seq_len=64", "--data.corpus_max_mb=0.3",
            f"--data.cache_dir={data_cache}", "--train.eval_batches=2", *more]


def assert_one_line(code: int, err: str, words: str) -> None:
    assert code != 0
    lines = [line for line in err.splitlines() if line.startswith("meshtron: error: ")]
    assert len(lines) == 1 and words in lines[0], err
    assert "Traceback" not in err


def test_empty_space_is_one_line(capsys):
    code, _, err = archsearch(capsys, "--budget-flops", "1e12", *TINY, "--layers", "2",
                              "--widths", "64,128", "--model.num_heads=5")
    assert_one_line(code, err, "the search space is empty")
    code, _, err = archsearch(capsys, "--budget-flops", "1e12", *TINY, "--layers", "2",
                              "--widths", "64", "--memory-limit", "64KiB")
    assert_one_line(code, err, "empty after pruning")
    code, _, err = archsearch(capsys, "--budget-flops", "1e12", *TINY, "--widths", "6x")
    assert_one_line(code, err, "--widths 6x")


def test_budget_too_small_is_one_line(capsys):
    code, _, err = archsearch(capsys, "--budget-flops", "1e6", *TINY, "--layers", "2,4",
                              "--widths", "64")
    assert_one_line(code, err, "too small for any shape")


def test_one_size_of_proxy_is_said_before_it_trains(capsys):
    """A budget whose proxy share trains only one shape past 4x the warm-up cannot fit a law
    (two sizes needed): said at once, not after that proxy has trained (the README's budget
    with the default 20-step warm-up was such a case)."""
    code, _, err = archsearch(capsys, "--budget-flops", "2e10", *TINY, "--train.warmup_steps=20",
                              "--layers", "1,2", "--widths", "32,64")
    assert_one_line(code, err, "only one size of shape (1x32 h2/kv1 ffn96) can train as a proxy")
    assert "at least 80 steps" in err and "proxy 1/" not in err
    code, _, err = archsearch(capsys, "--budget-flops", "3e10", *TINY, "--train.warmup_steps=20",
                              "--layers", "1,2", "--widths", "32,64", "--max-minutes", "1e-9")
    assert "planned: 2 proxy runs" in err  # two sizes: the search goes on


def test_a_cluster_needs_proxy_steps_or_a_law(capsys):
    code, _, err = archsearch(capsys, "--budget-gpu-hours", "10", *TINY, "--layers", "2",
                              "--widths", "64", "--cluster.gpu=h100-sxm", "--cluster.gpus=8")
    assert_one_line(code, err, "--proxy-steps")


def test_cluster_plan_with_a_given_law(capsys, tmp_path):
    out = tmp_path / "arch.json"
    code, stdout, err = archsearch(
        capsys, "--budget-gpu-hours", "100", *TINY, "--train.seq_len=512", "--layers", "2,4,8",
        "--widths", "256,512", "--cluster.gpu=h100-sxm", "--cluster.gpus=8", "--law",
        "chinchilla", "--json", str(out), "--search-top", "3")
    assert code == 0, err
    doc = json.loads(out.read_text())
    chosen, prediction = doc["chosen"], doc["prediction"]
    assert prediction["layout"] and prediction["tokens"] == pytest.approx(
        doc["budget"]["seconds"] * prediction["tokens_per_s"])
    assert {k: prediction[k] for k in chosen} == chosen
    assert doc["front"][-1]["predicted_loss"] == min(s["predicted_loss"] for s in doc["shapes"])


def failing(reason: str):
    def start_trial(config_path, nproc, log_path, timeout_s, env=None):
        return reason
    return start_trial


def test_failed_proxies_are_said_and_too_few_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(proxy_runs, "start_trial", failing("exit 1: boom"))
    args = ["--budget-flops", "1e11", *TINY, "--layers", "1,2", "--widths", "32,64",
            "--proxies", "2", "--proxy-steps", "12", "--proxy-points", "3"]
    code, _, err = archsearch(capsys, *args)
    assert_one_line(code, err, "every proxy run failed")
    assert err.count("failed: exit 1: boom; the fit goes on") == 2


@pytest.fixture
def crash_third(monkeypatch):
    """Proxy runs for real, the third killed at its second step (a trial that crashes)."""
    real, calls = proxy_runs.start_trial, []

    def start_trial(config_path, nproc, log_path, timeout_s, env=None):
        calls.append(config_path)
        faults = {"MESHTRON_FAULTS": "kill:step=2"} if len(calls) == 3 else None
        return real(config_path, nproc, log_path, timeout_s, faults)

    monkeypatch.setattr(proxy_runs, "start_trial", start_trial)
    return calls


@pytest.mark.slow
def test_archsearch_end_to_end_with_real_proxies(capsys, monkeypatch, tmp_path, data_cache,
                                                 crash_third):
    """Four proxies, the third crashing (said, left out of the fit); the second round trains
    the shape the first law ranks best twice as far, continuing its own run (the same
    directory, from its last checkpoint); the report, the config and the plot; a rerun reuses
    every finished run."""
    out, cfg_out, png = tmp_path / "arch.json", tmp_path / "arch.yaml", tmp_path / "arch.png"
    proxies = tmp_path / "proxies"
    args = ["--budget-flops", "3e11", *tiny_args(data_cache), "--layers", "1,2", "--widths",
            "32,64", "--proxies", "4", "--proxy-steps", "12", "--proxy-points", "3",
            "--refine", "1", "--proxy-dir", str(proxies), "--json", str(out),
            "--output-config", str(cfg_out), "--plot", str(png)]
    code, stdout, err = archsearch(capsys, *args)
    assert code == 0, err
    assert len(crash_third) == 5
    assert "proxy 3/4" in err and "failed: " in err and "the fit goes on without it" in err
    assert "refining: 1 shape" in err and "refine 1/1" in err and "extending" in err, err
    assert "Pareto front" in stdout and "chosen: " in stdout
    doc = json.loads(out.read_text())
    assert set(doc["chosen"]) >= {"model.num_layers", "model.hidden_size", "model.num_heads",
                                  "model.num_kv_heads", "model.ffn_hidden_size"}
    assert doc["front"] and doc["front"][-1]["predicted_loss"] == doc["prediction"][
        "predicted_loss"]
    assert [p["failure"] is None for p in doc["proxies"]] == [True, True, False, True]
    assert [p["steps"] for p in doc["proxies"]].count(24) == 1
    refined = next(p for p in doc["proxies"] if p["steps"] == 24)
    steps = [r["step"] for r in read_metrics(Path(refined["run_dir"])) if "val_loss" in r]
    assert steps == [4, 8, 12, 16, 24]  # the first run's evaluations, then the longer one's
    # 3 points of each 12-step proxy (steps 4, 8, 12), 4 of the refined one (from step 6 on)
    assert doc["fit"]["points"] == 10, doc["fit"]
    assert doc["fit"]["source"] == "3 proxy runs, 1 failed, 1 refined"
    cfg = load_config(cfg_out)
    assert {f"model.{k}": getattr(cfg.model, k) for k in
            ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size")} == {
        k: v for k, v in doc["chosen"].items() if k != "model.moe.num_experts"}
    assert cfg.train.steps == doc["prediction"]["steps"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a rerun reuses the finished proxies, the refined one included (and runs the failed one
    # again)
    calls = []
    monkeypatch.setattr(proxy_runs, "start_trial",
                        lambda path, *a, **k: calls.append(path) or "exit 1: again")
    code, _, err = archsearch(capsys, *args)
    assert code == 0, err
    assert len(calls) == 1 and err.count("reusing") == 4
    assert json.loads(out.read_text())["chosen"] == doc["chosen"]


def test_a_longer_proxy_is_the_same_run(tmp_path):
    cfg = load_config(overrides=TINY)
    short = proxy_runs.proxy_config(cfg, proxy_runs.Proxy(SHAPE, 1.0, 12), 3, tmp_path)
    long = proxy_runs.proxy_config(cfg, proxy_runs.Proxy(SHAPE, 1.0, 24), 3, tmp_path)
    assert proxy_runs.run_key(short) == proxy_runs.run_key(long)
    assert long.train.min_lr == long.train.lr and long.parallel.tp == 1
    other = proxy_runs.proxy_config(cfg, proxy_runs.Proxy(Shape(2, 64, 4, 4, 128), 1.0, 12), 3,
                                    tmp_path)
    assert proxy_runs.run_key(other) != proxy_runs.run_key(short)


def test_choose_spreads_proxies_in_size():
    candidates = [proxy_runs.Proxy(Shape(1, w, 1, 1, 4), float(w), 20)
                  for w in (1, 2, 4, 8, 16, 32, 64)]
    assert [p.n for p in proxy_runs.choose(candidates, 3)] == [1.0, 8.0, 64.0]
    assert len(proxy_runs.choose(candidates, 10)) == 7

