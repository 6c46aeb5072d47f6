"""What a run reports and leaves behind, each checked against its definition: the learning-rate
curve, MFU, TensorBoard scalars, plots of several runs, the space form of overrides, no
leftover temporary checkpoint directories, and no bias update on a skipped step."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.config.parse import split_overrides as _split_overrides
from meshtron.errors import MeshtronError
from meshtron.models.flops import training_flops_per_token
from meshtron.optim.lr_schedule import learning_rate
from meshtron.training.metrics import read_metrics
from meshtron.training.trainer import Trainer
from tests.parity import test_overrides
from tests.test_trainer import PNG_MAGIC, config, quiet


def test_cosine_decay_after_warm_up():
    t = load_config(overrides=["--train.lr=0.01", "--train.min_lr=0.001",
                               "--train.warmup_steps=10", "--train.steps=110"]).train
    assert learning_rate(9, t) == pytest.approx(0.01)  # the last warm-up step reaches lr
    assert learning_rate(10, t) == pytest.approx(0.01)  # decay starts from lr
    assert learning_rate(60, t) == pytest.approx(0.0055)  # halfway: (lr + min_lr) / 2
    assert learning_rate(35, t) == pytest.approx(
        0.001 + 0.5 * 0.009 * (1 + math.cos(math.pi * 0.25)))
    assert learning_rate(110, t) == learning_rate(500, t) == pytest.approx(0.001)
    decay = [learning_rate(s, t) for s in range(10, 111)]
    assert all(a > b for a, b in zip(decay, decay[1:]))


def test_overrides_take_a_value_after_a_space():
    assert _split_overrides(["--train.steps", "7", "--model.hidden_size=64",
                             "--train.lr", "0.5"]) == [
        "--train.steps=7", "--model.hidden_size=64", "--train.lr=0.5"]
    cfg = load_config(overrides=_split_overrides(["--train.steps", "7"]))
    assert cfg.train.steps == 7
    with pytest.raises(MeshtronError, match="needs a value"):
        _split_overrides(["--train.steps"])
    with pytest.raises(MeshtronError, match="needs a value"):
        _split_overrides(["--train.steps", "--train.lr=1"])


def test_mfu_tensorboard_and_no_leftover_temporaries(data_cache, tmp_path):
    """MFU is model FLOPs per second over train.peak_flops; TensorBoard holds the same
    scalars as metrics.jsonl; a stale half-written save of a step is removed once that step
    is saved, and a successful save leaves no temporary directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    stale = run_dir / "checkpoints" / ".tmp-step_00000002-0123abcd"
    stale.mkdir(parents=True)
    (stale / "shard-00000.safetensors").write_bytes(b"torn")
    cfg = config(data_cache, run_dir, 3, "--train.log_every=1", "--train.peak_flops=1e12",
                 "--checkpoint.every=2")
    logs: list[str] = []
    trainer = Trainer(cfg, log=logs.append)
    trainer.run()
    assert "mfu: against 1 TFLOP/s per rank, from train.peak_flops" in logs
    rows = read_metrics(run_dir)
    per_token = training_flops_per_token(trainer.cfg.model, cfg.train.seq_len)
    for row in rows:
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * per_token / 1e12, rel=1e-9)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [
        "step_00000002", "step_00000003"]

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    for key in ("loss", "lr", "grad_norm", "mfu", "tokens_per_s"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [1, 2, 3], key
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in rows], rel=1e-6)


def test_plot_draws_every_run(data_cache, tmp_path, capsys):
    runs = []
    for name, lr in (("a", "0.003"), ("b", "0.0003")):
        Trainer(config(data_cache, tmp_path / name, 2, "--train.log_every=1",
                       f"--train.lr={lr}", "--train.min_lr=0"), log=quiet).run()
        runs.append(str(tmp_path / name))
    images = {}
    for label, chosen in (("one", runs[:1]), ("both", runs)):
        output = tmp_path / f"{label}.png"
        assert main(["plot", *chosen, "--output", str(output)]) == 0
        images[label] = output.read_bytes()
        assert images[label][:8] == PNG_MAGIC
    assert images["one"] != images["both"]
    assert main(["plot", runs[0], str(tmp_path / "missing")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_a_skipped_step_leaves_the_expert_bias_alone(data_cache, tmp_path):
    """An fp16 step whose gradients overflow is skipped; the aux-loss-free bias update, which
    follows the step's routing, must be skipped with it (the next clean step does move it)."""
    moe = ["--model.moe.num_experts=4", "--model.moe.top_k=2", "--model.moe.expert_ffn_size=32",
           "--model.moe.aux_loss=0", "--model.moe.bias_update=0.01", "--precision.dtype=fp16"]
    trainer = Trainer(config(data_cache, tmp_path / "run", 1, *moe), log=quiet)
    trainer.precision.scaler.scale = 2.0**40  # the scaled loss overflows fp16 gradients
    biases = [layer.router.expert_bias for layer in trainer.model.moe_layers().values()]
    result = trainer.run()
    assert not math.isfinite(result.grad_norms[0]) and biases
    assert all(torch.equal(b, torch.zeros_like(b)) for b in biases)

    clean = Trainer(config(data_cache, tmp_path / "clean", 1, *moe), log=quiet)
    clean.run()
    assert any(layer.router.expert_bias.abs().sum() > 0
               for layer in clean.model.moe_layers().values())


def test_plot_of_a_file_that_is_no_run_is_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("x")
    assert main(["plot", str(tmp_path / "notes.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a run directory" in err[0]




def test_a_run_with_one_logged_point_is_drawn_as_a_marker(tmp_path):
    """A line through a single point is invisible; short series get a marker at each point."""
    from matplotlib.figure import Figure

    from meshtron.training.plot import MARKED_POINTS, draw_runs, plot_runs

    run = tmp_path / "one"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    ax = Figure().add_subplot()
    draw_runs(ax, [run])
    (line,) = ax.get_lines()
    assert line.get_xydata().tolist() == [[1.0, 5.0]]
    assert line.get_marker() not in ("None", "", " ", None) and line.get_markersize() > 0
    assert plot_runs([run], tmp_path / "one.png").read_bytes()[:8] == PNG_MAGIC

    long = tmp_path / "long"
    long.mkdir()
    (long / "metrics.jsonl").write_text("".join(
        f'{{"step": {s}, "loss": 1.0}}\n' for s in range(MARKED_POINTS + 1)))
    ax = Figure().add_subplot()
    draw_runs(ax, [long])
    assert ax.get_lines()[0].get_marker() in ("None", None)  # long curves stay plain lines


@pytest.mark.slow
def test_weights_and_biases_offline_gets_the_rows(data_cache, tmp_path):
    """run.wandb=offline: a Weights & Biases run under <run.dir>/wandb, written without any
    network, holding the metrics' names and values (wandb-core writes them as protobuf, whose
    keys and JSON values read as bytes)."""
    wandb = pytest.importorskip("wandb")
    run = tmp_path / "run"
    assert main(["train", *test_overrides(data_cache, str(run), 2), "--train.log_every=1",
                 "--run.wandb=offline"]) == 0
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = [k.encode() for k in ("grad_norm", "skipped_steps", "tokens_per_s",
                                 f"{rows[-1]['loss']:.4f}"[:5])]
    # wandb-core writes the file in its own service process, which may still be flushing
    # the records when ``finish()`` has returned (a clean CI run once read the bare 7-byte
    # header); ``teardown`` returns once that process has exited, its file closed
    wandb.teardown()
    data = files[0].read_bytes()
    for key in keys:
        assert key in data, key


def test_weights_and_biases_without_the_package_is_one_line(monkeypatch, tmp_path):
    from meshtron.training import metrics

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(MeshtronError, match=r"run.wandb=offline needs the wandb package: pip "
                       r"install 'meshtron\[wandb\]'"):
        metrics._wandb_run(tmp_path, "offline", "meshtron", {})


def test_eval_generate_logs_greedy_samples_and_leaves_the_numbers_alone(data_cache, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = {}
    for name, extra in (("plain", ()), ("sampled", ("--train.eval_generate=5",))):
        cfg = config(data_cache, tmp_path / name, 2, "--train.eval_every=1",
                     "--train.eval_batches=1", *extra)
        logs: list[str] = []
        runs[name] = (Trainer(cfg, log=logs.append).run(), logs)
    (plain, _), (sampled, logs) = runs["plain"], runs["sampled"]
    assert sampled.losses == plain.losses and sampled.grad_norms == plain.grad_norms
    assert sampled.val_loss == plain.val_loss
    lines = [line for line in logs if line.startswith("sample ")]
    assert [line.split(":")[0] for line in lines] == [
        "sample 1 at step 1", "sample 2 at step 1", "sample 1 at step 2", "sample 2 at step 2"]
    events = EventAccumulator(str(tmp_path / "sampled" / "tb"))
    events.Reload()
    assert {"samples/1/text_summary", "samples/2/text_summary"} <= set(events.Tags()["tensors"])
    with pytest.raises(MeshtronError, match=r"^train.eval_generate samples on one model replica "
                       r"and does not combine with parallel.cp=2, parallel.zero=3 yet"):
        load_config(overrides=["--train.eval_generate=4", "--parallel.cp=2", "--parallel.zero=3"])
