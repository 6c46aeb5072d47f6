"""`meshtron tune --trial`: the best candidates run through the real trainer, the table shows
what they measured, and the error is folded back into the profile file."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROFILE = {
    "name": "test-cpu", "source": "hand-written for tests/test_tune_trials.py",
    "gpus_per_node": 8, "memory_bytes": 16e9, "memory_bandwidth": 1e10,
    "peak_flops": {"fp32": 5e10, "bf16": 5e10}, "compute_units": 2,
    "intra_node": {"bandwidth": 1e9, "latency": 1e-4},
    "inter_node": {"bandwidth": 1e9, "latency": 1e-4},
    "memory_reserved_bytes": 200_000_000,
}
JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def tune(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    return subprocess.run([sys.executable, "-m", "meshtron", "tune", *args], cwd=cwd,
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_two_trials_measure_pick_and_fold_into_the_profile(tmp_path, data_cache):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    proc = tune(tmp_path, "--model.preset=tiny", "--data.vocab_size=512",
                "--data.corpus_max_mb=0.3", f"--data.cache_dir={data_cache}",
                "--train.seq_len=32", "--train.global_batch=4", f"--cluster.gpu={profile}",
                "--cluster.gpus=1", "--trial", "2", "--nproc", "1", "--trial-steps", "3",
                "--trial-dir", str(tmp_path / "trials"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if re.match(r"tp1 cp1 pp1 ", line)]
    assert len(rows) == 2, proc.stdout
    for row in rows:  # predicted s, measured s, error, predicted GiB, measured GiB, error
        figures = row.split("none", 1)[1].split()
        assert len(figures) == 6 and all(re.fullmatch(r"[+-]?[\d.]+%?", f) for f in figures), row
        assert float(figures[1]) > 0 and float(figures[4]) > 0, row
    assert "winner by measurement: " in proc.stdout
    assert f"wrote the corrections into {profile}" in proc.stdout
    saved = json.loads(profile.read_text())
    assert saved["time_correction"] != 1.0 and saved["memory_correction"] != 1.0
    assert {k: saved[k] for k in PROFILE if k not in ("intra_node", "inter_node")} == {
        k: v for k, v in PROFILE.items() if k not in ("intra_node", "inter_node")}
    for i in (1, 2):
        assert (tmp_path / "trials" / str(i) / "metrics.jsonl").is_file()


@pytest.mark.parametrize("args, fragment", [
    (("--cluster.gpus=2", "--trial", "1", "--nproc", "1"),
     "--nproc 1 must equal --cluster.gpus=2"),
    (("--cluster.gpus=1", "--trial", "1", "--trial-steps", "1"),
     "--trial-steps must be at least 2"),
])
def test_trials_that_cannot_measure_the_plan_are_one_line(tmp_path, args, fragment):
    proc = tune(tmp_path, "--model.preset=tiny", "--model.vocab_size=512",
                "--cluster.gpu=h100-sxm", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshtron: error: "), proc.stderr
    assert fragment in lines[0], lines[0]
    assert not list(tmp_path.iterdir())  # nothing ran, nothing was written


def test_a_trial_that_fails_is_named_and_all_failing_is_an_error(tmp_path):
    """Each failed run is one line naming it and why; when none measured anything the command
    stops with one error line (exit 2) and the profile is left as it was."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    proc = tune(tmp_path, "--model.preset=tiny", "--model.vocab_size=512",
                f"--data.path={tmp_path / 'missing.txt'}", f"--cluster.gpu={profile}",
                "--cluster.gpus=1", "--trial", "1", "--nproc", "1",
                "--trial-dir", str(tmp_path / "trials"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    failed = [line for line in lines if line.startswith("trial 1 (tp1 ")]
    assert len(failed) == 1 and "failed: exit 2: meshtron: error: " in failed[0], proc.stderr
    assert lines[-1].startswith("meshtron: error: every trial run failed"), lines[-1]
    assert json.loads(profile.read_text()) == PROFILE
