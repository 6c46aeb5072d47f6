"""benchmarks/scaling.py: its formulas against exact quantities, its growth verdicts on made-up
curves, and one quick run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import scaling  # noqa: E402
import scaling_point  # noqa: E402

from meshtron.config import load_config  # noqa: E402
from meshtron.models.flops import training_flops_per_token  # noqa: E402
from meshtron.models.init import initialize  # noqa: E402
from meshtron.models.transformer import Transformer  # noqa: E402
from meshtron.training.memory import measure_saved_bytes  # noqa: E402


def test_ops_fall_into_their_time_classes():
    assert scaling_point.op_class("aten::mm") == "gemm"
    assert scaling_point.op_class("aten::_scaled_dot_product_flash_attention_for_cpu") \
        == "attention"
    assert scaling_point.op_class("aten::_log_softmax") == "loss"
    assert scaling_point.op_class("aten::_fused_adamw_") == "optimizer"
    assert scaling_point.op_class("aten::mul") == "elementwise"


def test_flop_formulas_add_up_to_the_models_training_flops():
    shape = scaling_point.Shape("s", scaling_point.llama(2, 128), seq=64, micro_batch=2,
                                micro_batches=3)
    f = scaling_point.formulas(shape)
    cfg = load_config(overrides=shape.model).model
    assert f["model_flops"] == training_flops_per_token(cfg, 64) * 384
    assert f["gemm"] + f["attention"] == pytest.approx(f["model_flops"], rel=1e-12)
    full = scaling_point.formulas(scaling_point.Shape("s", shape.model, 64, 2, 3, "full"))
    assert full["gemm"] == pytest.approx(f["gemm"] * 8 / 6)  # the forward runs twice
    assert full["saved_bytes"] < f["saved_bytes"]


def test_saved_bytes_formula_is_what_autograd_keeps():
    shape = scaling_point.Shape("s", scaling_point.llama(2, 128, vocab=512), seq=32,
                                micro_batch=2)
    cfg = load_config(overrides=shape.model)
    model = Transformer(cfg.model)
    initialize(model, seed=0, std=cfg.model.init_std, num_layers=cfg.model.num_layers)
    batch = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    # the formula counts activations; the int64 token ids the embedding and the loss keep
    # (two per token and one more per row of the window, at most) and the loss's mask of the
    # targets that count (one byte per token) are left out
    ids = 8 * (2 * 64 + 2) + 64
    saved = measure_saved_bytes(model, batch)
    assert saved == pytest.approx(scaling_point.formulas(shape)["saved_bytes"], abs=ids)


def point(step_s: float, flops: float, gemm_s: float, peak: float, peak_formula: float) -> dict:
    classes = dict.fromkeys(scaling_point.TIME_CLASSES, 0.0) | {"gemm": gemm_s}
    formula = dict.fromkeys(scaling_point.TIME_CLASSES, 1.0) | {
        "model_flops": flops, "gemm": flops, "peak_bytes": peak_formula,
        "step_bytes": 1.0, "saved_bytes": 1.0}
    return {"median_s": step_s, "class_s": classes, "formula": formula, "peak_bytes": peak,
            "step_bytes": None, "saved_bytes": None}


def test_growth_names_what_outgrows_its_formula():
    # FLOPs x4; time x4 (as the formula), gemm x6 (faster), peak memory x2 against x4
    points = [point(1.0, 1e9, 0.5, 100.0, 100.0), point(4.0, 4e9, 3.0, 200.0, 400.0)]
    rows = {r["term"]: r for r in scaling.growth_table(points, tolerance=0.2)}
    assert rows["step_time"]["growth"] == pytest.approx(1.0)
    assert rows["step_time"]["exponent"] == pytest.approx(1.0)
    assert rows["step_time"]["verdict"] == "as its formula"
    assert rows["gemm"]["growth"] == pytest.approx(1.5)
    assert rows["gemm"]["verdict"] == "faster than its formula"
    assert rows["peak_bytes"]["exponent"] == pytest.approx(0.5)
    assert rows["peak_bytes"]["verdict"] == "slower than its formula"
    assert "step_bytes" not in rows  # not measured: no verdict


def test_a_small_share_is_not_named():
    points = [point(1.0, 1e9, 0.01, 1.0, 1.0), point(1.0, 1e9, 0.04, 1.0, 1.0)]
    gemm = next(r for r in scaling.growth_table(points, 0.2) if r["term"] == "gemm")
    assert gemm["growth"] == pytest.approx(4.0) and gemm["share"] < scaling.SHARE_TO_NAME
    assert gemm["verdict"] == "as its formula"


@pytest.mark.slow  # a fresh interpreter and a spawned worker: 10-20 s on shared cores
def test_quick_run_prints_tables_and_writes_the_report(tmp_path):
    out = tmp_path / "scaling.json"
    run = subprocess.run([sys.executable, str(BENCHMARKS / "scaling.py"), "--quick",
                          "--configs", "micro-batches", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    points = report["sweeps"]["micro-batches"]["points"]
    assert [p["tokens"] for p in points] == [128, 256]
    for p in points:
        assert p["median_s"] > 0 and p["peak_bytes"] > 0 and p["saved_bytes"] > 0
        assert sum(p["class_s"].values()) == pytest.approx(p["median_s"])
        # one micro-batch's, exact but for the token ids (below 16 bytes a token)
        assert p["saved_bytes"] == pytest.approx(p["formula"]["saved_bytes"], abs=16 * 256)
    terms = {r["term"] for r in report["sweeps"]["micro-batches"]["growth"]}
    assert {"step_time", "gemm", "peak_bytes"} <= terms
    assert "## micro-batches" in run.stdout and "growing faster than their formula" in run.stdout
