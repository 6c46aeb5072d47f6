"""Crash safety of the checkpoint directory format."""

import json
import os

import pytest
import torch

from meshtron.checkpoint.store import (
    find_latest,
    load_tensors,
    read_manifest,
    save_checkpoint,
    verify_checkpoint,
)
from meshtron.errors import MeshtronError


def save(root, step, value=1.0, keep_last=0):
    tensors = {"model.safetensors": {"w": torch.full((3, 2), value), "s": torch.tensor(2.0)}}
    return save_checkpoint(root, step, tensors, meta={"note": "x"}, keep_last=keep_last)


def test_save_then_load(tmp_path):
    path = save(tmp_path, 10, value=4.0)
    assert path.name == "step_00000010"
    assert (tmp_path / "latest").read_text().strip() == "step_00000010"
    manifest = verify_checkpoint(path)
    assert manifest["step"] == 10 and manifest["note"] == "x"
    loaded = load_tensors(path, "model.safetensors")
    assert torch.equal(loaded["w"], torch.full((3, 2), 4.0)) and loaded["s"].item() == 2.0
    assert not list(tmp_path.glob(".tmp-*"))


def test_newest_complete_checkpoint_wins_and_half_written_ones_are_skipped(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20)
    # A crash mid-save leaves a temporary directory; a crash between rename and manifest
    # cannot happen, but a step directory without a manifest must still be ignored.
    (tmp_path / ".tmp-step_00000030-999").mkdir()
    (tmp_path / "step_00000040").mkdir()
    warnings = []
    assert find_latest(tmp_path, warn=warnings.append).name == "step_00000020"
    assert any(".tmp-step_00000030" in w for w in warnings)
    assert any("step_00000040 is incomplete" in w for w in warnings)


def test_corrupt_file_is_named_and_skipped(tmp_path):
    save(tmp_path, 10)
    newest = save(tmp_path, 20)
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (newest / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(MeshtronError, match=r"step_00000020/model.safetensors is corrupt"):
        verify_checkpoint(newest)
    warnings = []
    assert find_latest(tmp_path, warn=warnings.append).name == "step_00000010"
    assert warnings


def test_keep_last_prunes_old_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        save(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000004"]


def test_manifest_cannot_point_outside_its_directory(tmp_path):
    path = save(tmp_path, 1)
    manifest = json.loads((path / "meta.json").read_text())
    manifest["files"]["../../etc/passwd"] = "0" * 64
    (path / "meta.json").write_text(json.dumps(manifest))
    with pytest.raises(MeshtronError, match="names a file outside itself"):
        read_manifest(path)


def test_empty_or_missing_root_has_no_checkpoint(tmp_path):
    assert find_latest(tmp_path / "nothing") is None
    os.makedirs(tmp_path / "empty")
    assert find_latest(tmp_path / "empty") is None


def test_a_run_directory_finds_its_checkpoints_from_anywhere(tmp_path):
    from meshtron.checkpoint.loading import run_checkpoint_root

    run = tmp_path / "proj" / "runs" / "x"
    saved = {"run": {"dir": "runs/x"}, "checkpoint": {"dir": "ckpts/x"}}
    assert run_checkpoint_root(run, saved) == tmp_path / "proj" / "ckpts" / "x"
    saved["checkpoint"]["dir"] = None
    assert run_checkpoint_root(run, saved) == run / "checkpoints"
    saved["checkpoint"]["dir"] = str(tmp_path / "abs")
    assert run_checkpoint_root(run, saved) == tmp_path / "abs"
