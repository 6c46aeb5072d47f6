"""Checkpoints survive a crash mid-save, and an asynchronous save writes what a synchronous
one does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.checkpoint.store import find_latest, open_checkpoint, verify_checkpoint
from meshtron.config import load_config
from meshtron.training.trainer import train
from tests.parity import test_overrides


def test_async_save_writes_the_same_files_as_a_sync_save(data_cache, tmp_path):
    shards = {}
    for mode in ("false", "true"):
        run_dir = tmp_path / f"async-{mode}"
        cfg = load_config(overrides=test_overrides(data_cache, str(run_dir), steps=3)
                          + [f"--checkpoint.async={mode}", "--checkpoint.every=2"])
        train(cfg, log=lambda m: None)
        for step in (2, 3):
            path = run_dir / "checkpoints" / f"step_{step:08d}"
            manifest = verify_checkpoint(path)
            shards[mode, step] = ((path / "shard-00000.safetensors").read_bytes(),
                                  json.dumps(manifest["tensors"], sort_keys=True))
    for step in (2, 3):
        assert shards["false", step] == shards["true", step], f"step {step} differs"


@pytest.mark.slow
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_chosen(data_cache, tmp_path):
    """The trainer SIGKILLs itself inside step 4's save (``MESHTRON_FAULTS=save:step=4``: its
    shard written, the checkpoint not complete; a kill timed by polling for the temporary
    directory raced the save's completion); the newest complete checkpoint is then step 3,
    verifies, and training resumes from it."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    model = test_overrides(data_cache, str(run_dir), steps=6) + [
        "--model.hidden_size=128", "--model.ffn_hidden_size=512"]
    overrides = model + ["--checkpoint.every=1", "--checkpoint.keep_last=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MESHTRON_FAULTS": "save:step=4"}
    proc = subprocess.run([sys.executable, "-m", "meshtron", "train", *overrides],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                          timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    in_flight = [p.name for p in root.glob(".tmp-step_*")]
    assert len(in_flight) == 1 and "step_00000004" in in_flight[0], in_flight
    killed_during, killed_step = in_flight[0], 4
    warnings: list[str] = []
    chosen = find_latest(root, warn=warnings.append)
    assert chosen is not None and int(chosen.name.split("_")[1]) == killed_step - 1
    verify_checkpoint(chosen)
    open_checkpoint(chosen)[1].read("model/embed.weight")
    chosen_step = int(chosen.name.split("_")[1])
    resumed = train(load_config(overrides=model + [
        "--checkpoint.resume=true", f"--train.steps={chosen_step + 1}"]), log=warnings.append)
    assert resumed.start_step == chosen_step
    assert any(killed_during in w for w in warnings) or not Path(root, killed_during).exists()
