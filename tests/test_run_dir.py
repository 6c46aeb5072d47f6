"""A run directory remembers its run: another model is refused up front, a resume from an
earlier step sets the later history aside, and a pipeline picks a micro-batch it can run."""

from __future__ import annotations

import json

import pytest

from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.plan import plan_run
from meshtron.training.metrics import read_metrics
from meshtron.training.run_dir import check_run_dir, model_differences
from meshtron.training.trainer import Trainer
from tests.parity import test_overrides
from tests.test_cli import meshtron


def quiet(message: str) -> None:
    """A log function that drops everything."""


def test_another_model_in_the_run_dir_is_refused_before_anything_starts(tmp_path):
    run_dir = tmp_path / "runs" / "default"
    run_dir.mkdir(parents=True)
    saved = load_config(overrides=["--data.vocab_size=4096", f"--run.dir={run_dir}"])
    saved.save(run_dir / "config.yaml")
    before = (run_dir / "config.yaml").read_text()

    same = load_config(overrides=["--data.vocab_size=4096", f"--run.dir={run_dir}",
                                  "--train.steps=7"])
    check_run_dir(same)  # training settings may change: the same run continues
    other = load_config(overrides=[f"--run.dir={run_dir}"])  # vocabulary 8192 by default
    assert model_differences(saved.to_dict(), other) == ["data.vocab_size: 4096 -> 8192"]

    for nproc in ("1", "2"):  # refused before launching: one line, not one per rank
        proc = meshtron("train", "--nproc", nproc, f"--run.dir={run_dir}",
                        "--model.num_layers=3", cwd=tmp_path)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("meshtron: error: "), proc.stderr
        assert "model.num_layers: 4 -> 3" in lines[0] and "--run.dir=NEW_DIR" in lines[0]
    assert (run_dir / "config.yaml").read_text() == before
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]

    (tmp_path / "afile").write_text("x")
    with pytest.raises(MeshtronError, match="is a file"):
        check_run_dir(load_config(overrides=[f"--run.dir={tmp_path / 'afile'}"]))


def test_a_nested_field_added_since_the_save_is_no_difference_and_a_changed_one_is():
    """A config saved before ``model.vision.state_dims`` existed still names the same model;
    a nested field that changed (the rotary scaling's factor) is a difference."""
    cfg = load_config(overrides=["--data.vocab_size=4096"])
    saved = cfg.to_dict()
    del saved["model"]["vision"]["state_dims"]
    assert model_differences(saved, cfg) == []
    saved["model"]["rope"]["factor"] = 8.0
    assert model_differences(saved, cfg) == ["model.rope.factor: 8.0 -> 1.0"]


def test_resume_from_an_earlier_step_sets_the_later_history_aside(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    overrides = test_overrides(data_cache, str(run_dir), 6) + [
        "--checkpoint.every=2", "--train.log_every=1"]
    first = Trainer(load_config(overrides=overrides), log=quiet).run()
    ckpts = run_dir / "checkpoints"

    logs: list[str] = []
    again = Trainer(load_config(overrides=overrides + [
        "--checkpoint.resume=true", "--checkpoint.resume_from=2"]), log=logs.append)
    assert again.step == 2
    assert sorted(p.name for p in ckpts.iterdir() if "step_" in p.name) == [
        "abandoned-step_00000004", "abandoned-step_00000006", "step_00000002"]
    assert any("metrics.replaced.jsonl" in line for line in logs)
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2]
    replaced = [json.loads(line)["step"]
                for line in (run_dir / "metrics.replaced.jsonl").read_text().splitlines()]
    assert replaced == [3, 4, 5, 6]

    second = again.run()  # the same steps again, with the same numbers
    assert second.losses == first.losses[2:]
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert (ckpts / "step_00000006").is_dir()

    with pytest.raises(MeshtronError, match="resume_from=5: no checkpoint"):
        Trainer(load_config(overrides=overrides + [
            "--checkpoint.resume=true", "--checkpoint.resume_from=5"]), log=quiet)


@pytest.mark.parametrize(("extra", "world", "expected"), [
    (["--parallel.pp=2"], 2, (4, 2)),  # global batch 8: the largest micro-batch with 2 of them
    (["--parallel.pp=2", "--train.global_batch=6"], 2, (3, 2)),
    (["--parallel.pp=2", "--parallel.vpp=2", "--parallel.schedule=interleaved"], 2, (4, 2)),
    (["--parallel.pp=2", "--train.micro_batch=2"], 2, (2, 4)),  # a set micro-batch is kept
])
def test_a_pipeline_without_a_micro_batch_gets_one_its_schedule_accepts(extra, world, expected):
    plan = plan_run(load_config(overrides=extra), world, 8192)
    assert (plan.micro_batch, plan.micro_batches) == expected
    with pytest.raises(MeshtronError, match="needs at least pp=4 micro-batches"):
        plan_run(load_config(overrides=["--parallel.pp=4", "--train.global_batch=2"]), 4, 8192)
