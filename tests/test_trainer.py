"""The training loop in-process: learning, exact resume, run directory, evaluation, accumulation."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from meshtron.checkpoint.store import open_checkpoint, verify_checkpoint
from meshtron.config import Config, load_config
from meshtron.errors import MeshtronError
from meshtron.training.metrics import REQUIRED_FIELDS, read_metrics
from meshtron.training.trainer import Trainer, train
from tests.parity import run_training, test_overrides

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def config(data_cache: str, run_dir: Path, steps: int, *extra: str) -> Config:
    """The tiny test config with ``extra`` overrides applied last."""
    return load_config(overrides=test_overrides(data_cache, str(run_dir), steps) + list(extra))


def quiet(message: str) -> None:
    """A log function that drops everything."""


class Interrupted(Exception):
    """Stands in for a crash (a kill, a node failure) right after a checkpoint."""


class CrashAfterSave(Trainer):
    """A trainer that dies right after writing the checkpoint of step ``crash_at``."""

    crash_at = 10

    def save(self) -> Path:
        path = super().save()
        if self.step == self.crash_at:
            raise Interrupted
        return path


# ----------------------------------------------------------------------------- learning


def unigram_entropy(data_cache: str, steps: int) -> float:
    """Nats per token of the best context-free model of the very tokens ``steps`` steps of
    the test run train on: what learning token frequencies alone would reach."""
    from meshtron.data import build_training_data

    cfg = load_config(overrides=test_overrides(data_cache, "unused", steps))
    data = build_training_data(cfg.data, cfg.train.seq_len, cfg.train.seed, log=quiet)
    targets = torch.cat([data.train_batch(k, cfg.train.global_batch)[:, 1:].reshape(-1)
                         for k in range(steps)])
    p = torch.bincount(targets).double() / targets.numel()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


@pytest.mark.slow
def test_loss_falls_below_the_unigram_baseline(data_cache, tmp_path):
    """60 steps take the tiny model from ln(512) = 6.24 to 5.03, past the 5.35 nats a
    model of token frequencies gets on the same tokens: it has learned from context."""
    steps = 60
    losses = run_training(test_overrides(data_cache, str(tmp_path / "run"), steps=steps))["loss"]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(512)) < 0.1  # starts from a uniform guess
    tail, baseline = sum(losses[-5:]) / 5, unigram_entropy(data_cache, steps)
    assert tail < baseline - 0.25, f"last 5 steps {tail:.4f} vs unigram {baseline:.4f}"


# ----------------------------------------------------------------------------- resume


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([], id="no-dropout"),
        pytest.param(["--model.dropout=0.1"], id="dropout"),
    ],
)
def test_resume_is_bit_identical_to_the_uninterrupted_run(data_cache, tmp_path, extra):
    # Both runs have train.steps=20: the LR schedule is a function of (step, train.steps), so
    # the interrupted run must plan for 20 steps too. It "crashes" right after the step-10
    # checkpoint, and a brand-new Trainer resumes from it.
    steps = 20
    whole_dir = tmp_path / "whole"
    whole = Trainer(config(data_cache, whole_dir, steps,
                           f"--checkpoint.dir={whole_dir / 'ckpt'}", *extra), log=quiet)
    whole_result = whole.run()
    assert len(whole_result.losses) == steps

    part_dir = tmp_path / "part"
    part = [f"--checkpoint.dir={part_dir / 'ckpt'}", "--checkpoint.every=10", *extra]
    first = CrashAfterSave(config(data_cache, part_dir, steps, *part), log=quiet)
    with pytest.raises(Interrupted):
        first.run()
    assert first.step == 10 and (part_dir / "ckpt" / "step_00000010" / "meta.json").is_file()

    logs: list[str] = []
    second = Trainer(config(data_cache, part_dir, steps, *part, "--checkpoint.resume=true"),
                     log=logs.append)
    assert second.step == 10
    assert any("resumed from" in line and "step_00000010" in line for line in logs)
    resumed = second.run()
    assert (resumed.start_step, resumed.end_step) == (10, 20)

    # Exact equality, not a tolerance: resuming must not change a single bit.
    assert resumed.losses == whole_result.losses[10:]
    assert resumed.grad_norms == whole_result.grad_norms[10:]
    whole_state, resumed_state = whole.model.state_dict(), second.model.state_dict()
    assert whole_state.keys() == resumed_state.keys()
    for name, tensor in whole_state.items():
        assert torch.equal(tensor, resumed_state[name]), f"parameter {name} differs"
    whole_opt, resumed_opt = whole.optimizer.adamw.state, second.optimizer.adamw.state
    for a, b in zip(whole_opt.values(), resumed_opt.values(), strict=True):
        for key in a:
            assert torch.equal(a[key], b[key]), f"optimizer state {key} differs"


def _complete_run_with_checkpoints(data_cache: str, run_dir: Path) -> Path:
    """10 steps with checkpoints at steps 5 and 10; returns the checkpoint root."""
    train(config(data_cache, run_dir, 10, "--checkpoint.every=5"), log=quiet)
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000005", "step_00000010"]
    return root


def test_half_written_checkpoints_are_skipped_and_corrupt_ones_named(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    root = _complete_run_with_checkpoints(data_cache, run_dir)
    good = root / "step_00000005"
    # The newest step directory has a damaged shard (its checksum no longer matches).
    corrupt = root / "step_00000010" / "shard-00000.safetensors"
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    # A step directory that never got its manifest, and a save that died before the rename.
    shutil.copytree(good, root / "step_00000015")
    (root / "step_00000015" / "meta.json").unlink()
    shutil.copytree(good, root / ".tmp-step_00000020-4242")

    with pytest.raises(MeshtronError, match=r"newest checkpoint is unusable: .*step_00000015 is "
                       "incomplete: meta.json is missing"):
        Trainer(config(data_cache, run_dir, 12, "--checkpoint.resume=true"), log=print)
    shutil.rmtree(root / "step_00000015")
    with pytest.raises(MeshtronError, match=r"step_00000010/shard-00000.safetensors is corrupt"):
        Trainer(config(data_cache, run_dir, 12, "--checkpoint.resume=true"), log=print)
    shutil.copytree(good, root / "step_00000015")
    (root / "step_00000015" / "meta.json").unlink()
    logs: list[str] = []
    trainer = Trainer(config(data_cache, run_dir, 12, "--checkpoint.resume=true",
                             "--checkpoint.on_corrupt=previous"), log=logs.append)
    assert trainer.step == 5
    warnings = [line for line in logs if line.startswith("warning:")]
    assert any(".tmp-step_00000020-4242" in w for w in warnings), warnings
    assert any("step_00000015" in w and "meta.json" in w for w in warnings), warnings
    assert any("step_00000010/shard-00000.safetensors is corrupt" in w for w in warnings)
    assert any("resumed from" in line and "step_00000005" in line for line in logs)
    _, reader = open_checkpoint(good)
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), reader.read(f"model/{name}")), f"{name} not restored"


@pytest.mark.parametrize(
    ("override", "field"),
    [("--model.hidden_size=32", "model.hidden_size"), ("--model.num_layers=3", "model.num_layers")],
)
def test_resume_with_another_model_shape_names_the_field(data_cache, tmp_path, override, field):
    saved_dir = tmp_path / "saved"
    train(config(data_cache, saved_dir, 2), log=quiet)
    ckpt = saved_dir / "checkpoints"
    assert (ckpt / "step_00000002" / "meta.json").is_file()
    cfg = config(data_cache, tmp_path / "other", 4, f"--checkpoint.dir={ckpt}",
                 "--checkpoint.resume=true", override)
    with pytest.raises(MeshtronError, match=field.replace(".", r"\.")) as err:
        Trainer(cfg, log=quiet)
    assert str(ckpt / "step_00000002") in str(err.value)


def test_refused_resume_leaves_the_run_directory_alone(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    first = Trainer(config(data_cache, run_dir, 2), log=quiet)
    first.run()
    original = first.cfg  # the planned config: the tokenizer's vocabulary filled in
    with pytest.raises(MeshtronError, match=r"model\.hidden_size"):
        Trainer(config(data_cache, run_dir, 4, "--checkpoint.resume=true",
                       "--model.hidden_size=32"), log=quiet)
    assert load_config(run_dir / "config.yaml") == original


# ----------------------------------------------------------------------------- run directory


def test_run_directory_contract(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    trainer = Trainer(config(data_cache, run_dir, 4, "--train.log_every=2", "--run.plot=true"),
                      log=quiet)
    result = trainer.run()
    assert result.run_dir == run_dir and (result.start_step, result.end_step) == (0, 4)

    # The resolved config, every value stated, loads back to the very same config.
    assert load_config(run_dir / "config.yaml") == trainer.cfg
    assert trainer.cfg.model.vocab_size == 512 and trainer.cfg.model.hidden_size == 64

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        for key in (*REQUIRED_FIELDS, "comm_bytes"):
            assert key in row, f"metrics row lacks {key}: {row}"
        assert math.isfinite(row["loss"]) and row["grad_norm"] > 0
        assert row["tokens_per_s"] > 0 and row["step_time_s"] > 0 and row["mem_peak_bytes"] > 0
        # Bytes sent per '<group>/<kind>'; a single process sends nothing.
        assert isinstance(row["comm_bytes"], dict) and not any(row["comm_bytes"].values())
    assert [r["loss"] for r in rows] == [result.losses[1], result.losses[3]]
    assert rows[0]["lr"] == pytest.approx(3e-3)  # step 2 is the end of the 2-step warm-up

    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert (run_dir / "loss.png").read_bytes()[:8] == PNG_MAGIC

    ckpt = run_dir / "checkpoints" / "step_00000004"
    assert result.checkpoint == ckpt
    for name in ("meta.json", "shard-00000.safetensors", "shard-00000.json", "tokenizer.json"):
        assert (ckpt / name).is_file(), f"checkpoint lacks {name}"
    manifest = verify_checkpoint(ckpt)
    assert manifest["step"] == 4 and manifest["optimizer"]["steps"] == 4
    assert manifest["config"] == trainer.cfg.to_dict()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    _, reader = open_checkpoint(ckpt)
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), reader.read(f"model/{name}"))
        state = trainer.optimizer.adamw.state[param]
        assert torch.equal(state["exp_avg"], reader.read(f"optim/{name}/exp_avg"))


def test_no_plot_when_disabled(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    train(config(data_cache, run_dir, 1), log=quiet)  # test_overrides sets run.plot=false
    assert (run_dir / "metrics.jsonl").is_file()
    assert not (run_dir / "loss.png").exists()


# ----------------------------------------------------------------------------- evaluation


def test_eval_rows_carry_validation_loss_and_perplexity(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    trainer = Trainer(config(data_cache, run_dir, 4, "--train.eval_every=2",
                             "--train.eval_batches=2", "--train.log_every=1"), log=quiet)
    result = trainer.run()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        if row["step"] % 2:
            assert "val_loss" not in row and "val_ppl" not in row
        else:
            assert 0 < row["val_loss"] < 10
            assert row["val_ppl"] == pytest.approx(math.exp(row["val_loss"]), rel=1e-12)
    assert rows[1]["val_loss"] != rows[3]["val_loss"]  # the model changed in between
    assert result.val_loss == rows[3]["val_loss"]
    # The value itself: torch's cross-entropy of the final model over the same batches.
    t, vocab = trainer.cfg.train, trainer.cfg.model.vocab_size
    batches = torch.cat([trainer.data.valid_batch(k, t.global_batch)
                         for k in range(t.eval_batches)])
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(batches[:, :-1])[..., :vocab]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).double(),
                                                 batches[:, 1:].reshape(-1))
    assert result.val_loss == pytest.approx(float(expected), rel=1e-6)


# ----------------------------------------------------------------------------- accumulation


@pytest.mark.slow
def test_grad_accumulation_matches_one_big_micro_batch(data_cache, tmp_path):
    steps = 10
    whole = run_training(test_overrides(data_cache, str(tmp_path / "mb8"), steps)
                         + ["--train.micro_batch=8"])
    accumulated = run_training(test_overrides(data_cache, str(tmp_path / "mb2"), steps)
                               + ["--train.micro_batch=2"])
    for key in ("loss", "grad_norm"):
        assert len(whole[key]) == len(accumulated[key]) == steps
        for step, (a, b) in enumerate(zip(whole[key], accumulated[key], strict=True), start=1):
            assert abs(a - b) <= 1e-5 * abs(a), f"{key} at step {step}: {b!r} vs {a!r}"
