"""What a checkpoint lacks is decided in the open on resume: an error, or a logged choice.

Each test writes a checkpoint with a real gap (an optimizer tensor dropped, weights only, no
masters, fewer saved RNG states than ranks) and resumes from it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from meshtron.checkpoint.store import open_checkpoint, save_tensors
from meshtron.checkpoint.train_state import _restore_rng, fresh_seed
from meshtron.errors import MeshtronError
from meshtron.training.trainer import Trainer, train
from tests.test_trainer import config, quiet

FORMAT_KEYS = ("format", "step", "world_size", "files", "tensors", "rng")


def _saved_run(data_cache: str, root: Path, *extra: str) -> Path:
    """Two steps with a checkpoint after the second; returns that checkpoint."""
    train(config(data_cache, root / "run", 2, "--checkpoint.every=2", *extra), log=quiet)
    return root / "run" / "checkpoints" / "step_00000002"


def _rewrite_without(checkpoint: Path, root: Path, drop) -> Path:
    """A copy of ``checkpoint`` (same manifest fields) without the tensors ``drop`` picks."""
    manifest, reader = open_checkpoint(checkpoint)
    tensors = {name: reader.read(name) for name in reader.tensors if not drop(name)}
    assert len(tensors) < len(reader.tensors), "nothing was dropped"
    meta = {k: v for k, v in manifest.items() if k not in FORMAT_KEYS}
    return save_tensors(root, manifest["step"], tensors, meta)


def _resume(data_cache: str, root: Path, checkpoint: Path, *extra: str) -> list[str]:
    logs: list[str] = []
    Trainer(config(data_cache, root / "resumed", 4, "--checkpoint.resume=true",
                   f"--checkpoint.dir={checkpoint}", *extra), log=logs.append)
    return logs


def test_a_missing_optimizer_tensor_is_an_error(data_cache, tmp_path):
    saved = _saved_run(data_cache, tmp_path)
    dropped = "optim/layers.0.mlp.down.weight/exp_avg_sq"
    broken = _rewrite_without(saved, tmp_path / "broken", lambda name: name == dropped)
    with pytest.raises(MeshtronError, match=f"lacks {dropped}: resuming would restart"):
        _resume(data_cache, tmp_path, broken)


def test_weights_only_start_fresh_moments_and_say_so(data_cache, tmp_path):
    saved = _saved_run(data_cache, tmp_path)
    weights = _rewrite_without(saved, tmp_path / "weights", lambda n: n.startswith("optim/"))
    logs = _resume(data_cache, tmp_path, weights)
    assert any("holds weights only: AdamW moments and step count start at zero" in line
               for line in logs)


def test_masters_come_from_fp32_parameters_only(data_cache, tmp_path):
    """An fp32 run resumed in bf16 takes its masters from the saved fp32 weights (exact, and
    logged); a bf16 checkpoint whose masters are gone cannot be resumed."""
    fp32 = _saved_run(data_cache, tmp_path / "fp32")
    logs = _resume(data_cache, tmp_path / "fp32", fp32, "--precision.dtype=bf16")
    assert any("masters taken from its fp32 parameters" in line for line in logs)

    bf16 = _saved_run(data_cache, tmp_path / "bf16", "--precision.dtype=bf16")
    _, reader = open_checkpoint(bf16)
    assert any(name.endswith("/master") for name in reader.tensors)
    no_masters = _rewrite_without(bf16, tmp_path / "bf16-broken",
                                  lambda name: name.endswith("/master"))
    with pytest.raises(MeshtronError, match="/master and .* more: resuming would restart"):
        _resume(data_cache, tmp_path / "bf16", no_masters, "--precision.dtype=bf16")


def test_a_rank_without_a_saved_rng_state_gets_its_own_seed(tmp_path):
    """Rank 1 of a run resumed from a one-rank checkpoint: seeded from (seed, step, rank),
    never given rank 0's state, and the log says which ranks."""
    torch.manual_seed(123)
    rank0_state = torch.get_rng_state()
    path = save_tensors(tmp_path, 7, {"model/w": torch.zeros(1)}, meta={})
    manifest, reader = open_checkpoint(path)
    manifest["data"] = {"seed": 5}
    logs: list[str] = []
    for rank in (0, 1):
        mesh = SimpleNamespace(global_rank=rank, layout=SimpleNamespace(world_size=2))
        _restore_rng(manifest, reader, mesh, logs.append)
        if rank == 0:
            assert torch.equal(torch.get_rng_state(), rank0_state)
    assert not torch.equal(torch.get_rng_state(), rank0_state)
    assert torch.equal(torch.get_rng_state(),
                       torch.Generator().manual_seed(fresh_seed(5, 7, 1)).get_state())
    assert logs[0] == ("the checkpoint holds RNG states of 1 ranks: ranks 1 to 1 are seeded "
                       "from train.seed, the step and their rank")
