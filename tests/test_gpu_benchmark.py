"""benchmarks/gpu.py in its CPU smoke mode: runs one mode of each kind, prints the table, writes
a report that parses (the model config, with its nested MoE section, once made the JSON writer
fail)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"
MODES = ("bf16", "bf16+compile", "tensorwise", "blockwise", "mxfp8", "nvfp4")
"""One mode of each kind: bf16, compiled, per-tensor FP8, block-wise FP8, MXFP8, NVFP4 (the
report's format is the same for all; delayed FP8 and compiled FP8 are config changes of these,
trained in tests/test_fp8_training.py and tests/test_compile.py: their smoke runs took 104 of
the 221 s, compiled FP8's cold Inductor compile 100 s)."""
FIGURES = {"gemm", "build_s", "warmup_steps", "timed_steps", "first_step_s", "step_times_s",
           "losses", "peak_memory_gib", "note", "median_step_s", "tokens_per_s", "mfu"}


@pytest.mark.slow  # a fresh interpreter, six modes and one Inductor compile
def test_smoke_mode_prints_the_table_and_writes_a_parsable_report(tmp_path):
    # the default --json, so the report lands in the working directory: here, not the repo
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--profile",
                          "--modes", ",".join(MODES)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["gpu-benchmark.json"]
    report = json.loads((tmp_path / "gpu-benchmark.json").read_text())

    assert report["smoke"] is True and report["machine"]["device"] == "cpu"
    assert report["model"]["num_layers"] == 2 and report["model"]["hidden_size"] == 128
    assert report["model"]["moe"]["num_experts"] == 0  # the nested MoEConfig, as a dict
    assert report["tokens_per_step"] == report["micro_batch"] * report["seq_len"]
    assert list(report["results"]) == list(MODES)
    for mode, figures in report["results"].items():
        assert figures.keys() >= FIGURES, f"{mode}: {figures}"
        assert figures["timed_steps"] == 1 and len(figures["losses"]) == 2
        assert figures["tokens_per_s"] > 0 and figures["median_step_s"] > 0
    assert report["results"]["blockwise"]["gemm"] == "emulated"
    assert report["results"]["tensorwise"]["gemm"] == "emulated"  # "auto" on CPU (fp8.py)
    for mode, figures in report["results"].items():  # --profile: the step by kind and phase
        profile = figures["profile"]
        assert profile["basis"] == "operator self CPU time"
        assert sum(profile["shares"].values()) == pytest.approx(1.0, abs=1e-3)
        assert profile["shares"]["gemm"] > 0 and profile["top"], mode
        assert set(profile["phases_s"]) == {"forward_backward", "reduce_and_norm",
                                            "optimizer"}
        assert 0 < profile["phases_s"]["forward_backward"] <= profile["total_s"] * 1.5
    assert report["goals"] == "not evaluated for --smoke"

    rows = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    table, shares = rows[: 2 + len(MODES)], rows[2 + len(MODES):]
    assert table[0].startswith("| mode | gemm | step s | tokens/s |")
    assert [row.split(" | ")[0].lstrip("| ") for row in table[2:]] == list(MODES)
    assert shares[0].startswith("| mode | profiled s | forward_backward s |")
    assert [row.split(" | ")[0].lstrip("| ") for row in shares[2:]] == list(MODES)
    assert "wrote gpu-benchmark.json" in run.stdout
