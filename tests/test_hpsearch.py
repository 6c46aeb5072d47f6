"""`meshtron hpsearch`: the search space, real trial processes (scored, pruned, crashing,
interrupted and resumed), the JSON / YAML / PNG it writes, and one-line refusals."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.hpsearch.proxies import WidthProxy
from meshtron.hpsearch.space import Dimension, default_space, parse_dimension, parse_space

ROOT = Path(__file__).resolve().parents[1]


def proxy_args(cache: str, steps: int = 10) -> list[str]:
    """A 2-layer, 32-wide llama on the test corpus: a trial is mostly its process start-up."""
    return ["--model.preset=tiny", "--model.num_layers=2", "--model.hidden_size=32",
            "--model.num_heads=2", "--model.num_kv_heads=2", "--model.ffn_hidden_size=64",
            "--model.max_seq_len=64", "--data.vocab_size=512", "--data.corpus_max_mb=0.3",
            f"--data.cache_dir={cache}", "--train.seq_len=32", "--train.global_batch=4",
            f"--train.steps={steps}", "--train.warmup_steps=2", "--train.eval_batches=2"]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshtron: error: "), err
    return err[0]


# --- the space (pure) -------------------------------------------------------------------------

def test_ranges_choices_and_types_follow_the_config_schema():
    lr = parse_dimension("train.lr=1e-4:3e-2:log")
    assert (lr.kind, lr.low, lr.high, lr.log) == ("float", 1e-4, 3e-2, True)
    assert lr.grid(3) == (1e-4, pytest.approx(math.sqrt(3e-6)), 3e-2)
    warm = parse_dimension("train.warmup_steps=0:10")
    assert warm.kind == "int" and warm.grid(4) == (0, 3, 7, 10)
    batch = parse_dimension("train.global_batch=8,16,32")
    assert batch.choices == (8, 16, 32) and all(type(c) is int for c in batch.choices)
    assert parse_dimension("model.mup=true,false").choices == (True, False)
    assert parse_dimension("train.recompute=none,full").choices == ("none", "full")
    assert parse_dimension("model.moe.top_k=1,2").choices == (1, 2)
    assert parse_dimension("train.lr=0.003").choices == (0.003,)  # one value pins it
    dist = lr.distribution()
    assert isinstance(dist, optuna.distributions.FloatDistribution) and dist.log
    grid = lr.distribution(grid_points=3)
    assert isinstance(grid, optuna.distributions.CategoricalDistribution)
    assert len(grid.choices) == 3


def test_the_default_space_is_the_four_fields_around_the_config():
    cfg = load_config(overrides=["--train.lr=0.002", "--train.global_batch=8",
                                 "--train.steps=40"])
    dims = {d.name: d for d in default_space(cfg)}
    assert list(dims) == ["train.lr", "train.warmup_steps", "train.global_batch",
                          "train.weight_decay"]
    assert (dims["train.lr"].low, dims["train.lr"].high) == (pytest.approx(2e-4),
                                                             pytest.approx(2e-2))
    assert dims["train.global_batch"].choices == (4, 8, 16)
    assert (dims["train.warmup_steps"].low, dims["train.warmup_steps"].high) == (0, 10)
    assert parse_space(None, cfg) == default_space(cfg)


@pytest.mark.parametrize("text, fragment", [
    ("train.lrr=1e-4:1e-2", "unknown config key 'train.lrr' (did you mean 'train.lr'?)"),
    ("trian.lr=1e-4:1e-2", "unknown config section 'trian' (did you mean 'train'?)"),
    ("train.lr=1e-2:1e-4", "the low end 0.01 must be below the high end 0.0001"),
    ("train.lr=0:1e-2:log", "a log range needs a positive low end"),
    ("train.lr=a:b", "'a' is not a finite number"),
    ("train.lr=1:2:3", "a range is LOW:HIGH or LOW:HIGH:log"),
    ("train.warmup_steps=0:2.5", "2.5 is not a whole number"),
    ("train.recompute=a:b", "train.recompute is not a number"),
    ("model.moe=1,2", "model.moe is a section"),
    ("train.lr", "write section.field=LOW:HIGH[:log]"),
    ("data.path=a,b", "cannot be searched"),
])
def test_a_bad_dimension_is_one_line(text, fragment):
    with pytest.raises(MeshtronError) as err:
        parse_dimension(text)
    assert fragment in str(err.value)


def test_batch_search_keeps_the_token_budget_and_lr_keeps_the_floor_ratio():
    base = load_config(overrides=["--train.global_batch=8", "--train.steps=40",
                                  "--train.warmup_steps=4", "--train.lr=0.004",
                                  "--train.min_lr=0.0004"])
    proxy = WidthProxy(None, ("--train.global_batch=8", "--train.steps=40",
                         "--train.warmup_steps=4", "--train.lr=0.004",
                         "--train.min_lr=0.0004"), base, width=128)
    cfg = proxy.config({"train.global_batch": 16, "train.lr": 0.01})
    assert (cfg.train.steps, cfg.train.warmup_steps) == (20, 2)
    assert cfg.train.min_lr == pytest.approx(0.001)
    assert (cfg.model.hidden_size, cfg.model.ffn_hidden_size) == (128, 384)
    assert (cfg.model.num_heads, cfg.model.num_kv_heads) == (8, 4)  # muP keeps the heads
    trial = proxy.trial_config({"train.global_batch": 16}, Path("/tmp/x"))
    assert trial.train.eval_every == trial.train.steps == 20
    assert trial.train.eval_batches * 16 == base.train.eval_batches * 8
    assert proxy.units(10, 16) == 20  # the pruner's resource: steps of the config's batch


# --- one-line refusals through the CLI --------------------------------------------------------

@pytest.mark.parametrize("args, fragment", [
    (["--space", "train.lrr=1e-4:1e-2"], "did you mean 'train.lr'?"),
    (["--space", "train.lr=1e-2:1e-4"], "must be below the high end"),
    (["--trials", "0"], "--trials must be at least 1, got 0"),
    (["--reduction-factor", "1"], "--reduction-factor must be at least 2"),
    (["--widths", "64,x"], "--widths 64,x: give whole numbers"),
    (["--widths", "63"], "--widths 63: "),
    (["--train.lrr=0.1"], "unknown config key 'train.lrr'"),
    (["--nproc", "2", "--space", "train.global_batch=3,5"],
     "the search space is empty after pruning: no value of train.global_batch can run "
     "(3: train.global_batch=3 is not divisible by the data-parallel size 2; 5:"),
    (["--space", "train.warmup_steps=-5:3"], "-5 cannot run: train.warmup_steps"),
    (["--widths", "64", "--space", "model.hidden_size=32,64"], "--widths sets it"),
    (["--space", "train.recompute=none,full", "--plot", "x.png"], "--plot needs a numeric"),
    (["--json", "FILE/out.json"], "--json"),
    (["--output-config", "."], "--output-config . is a directory"),
])
def test_bad_input_is_one_line_before_any_trial(tmp_path, capsys, monkeypatch, args, fragment):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("a file, not a folder")
    assert main(["hpsearch", "--model.preset=tiny", "--model.vocab_size=512", *args]) == 2
    assert fragment in one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]  # nothing ran or was written


# --- real trials ------------------------------------------------------------------------------

def test_search_writes_table_json_yaml_and_plot(data_cache, tmp_path, capsys):
    """Two learning rates on the grid: each trial a real `meshtron train`; the best is the
    completed trial of lowest validation loss, and its YAML trains as it is."""
    out = tmp_path / "hp.json"
    code = main(["hpsearch", *proxy_args(data_cache), "--sampler", "grid", "--pruner", "none",
                 "--space", "train.lr=0.003,0.0001", "--json", str(out), "--output-config",
                 str(tmp_path / "best.yaml"), "--plot", str(tmp_path / "hp.png"),
                 "--trial-dir", str(tmp_path / "runs")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(out.read_text())
    assert set(data) >= {"best", "trials"} and len(data["trials"]) == 2
    for trial in data["trials"]:
        assert set(trial) >= {"params", "loss", "status"} and trial["status"] == "complete"
        assert trial["steps"] == trial["planned_steps"] == 10
        assert math.isfinite(trial["loss"])
    lowest = min(data["trials"], key=lambda t: t["loss"])
    assert data["best"] == lowest["params"] and data["best_loss"] == lowest["loss"]
    for trial in data["trials"]:  # the score is the trial's own final validation loss
        rows = [json.loads(line) for line in (tmp_path / "runs" / "hpsearch" /
                str(trial["number"]) / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["val_loss"] == trial["loss"]
    cfg = load_config(tmp_path / "best.yaml")
    assert cfg.train.lr == data["best"]["train.lr"]
    assert cfg.train.min_lr == pytest.approx(cfg.train.lr * 0.1)  # the config's ratio
    assert cfg.model.hidden_size == 32 and cfg.train.steps == 10  # the user's own run
    assert (tmp_path / "hp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = captured.out.splitlines()
    assert table[0].split() == ["trial", "train.lr", "loss", "status", "steps"]
    assert f"{lowest['loss']:.4f}" in table[1]  # ranked: the best first
    assert "best: train.lr=" in captured.out


@pytest.mark.slow
def test_a_trial_that_falls_behind_is_pruned_through_the_command(data_cache, tmp_path,
                                                                 monkeypatch, capsys):
    """`meshtron hpsearch --pruner sha` itself: a first trial (lr 0.003) completes; resumed
    from its study file, the second (lr 1e-6, far behind at the first rung, step 4) is pruned
    there: its process killed (no final evaluation), told PRUNED in the journal and reported
    so in the JSON. No race decides it: the second trial stops itself (SIGSTOP) as step 7
    begins, so only the pruner can end it before --trial-timeout."""
    study, out = tmp_path / "hp.journal", tmp_path / "hp.json"
    # the grid sampler with seed 1 runs lr 0.003 first (the first assertion checks it)
    args = ["hpsearch", *proxy_args(data_cache), "--sampler", "grid", "--seed", "1",
            "--space", "train.lr=0.003,0.000001", "--pruner", "sha", "--min-steps", "4",
            "--study", str(study), "--json", str(out), "--trial-timeout", "240"]
    assert main([*args, "--trials", "1"]) == 0, capsys.readouterr().err
    first = json.loads(out.read_text())["trials"]
    assert [(t["params"]["train.lr"], t["status"]) for t in first] == [(0.003, "complete")]
    monkeypatch.setenv("MESHTRON_FAULTS", "stall:step=7")
    assert main([*args, "--trials", "2"]) == 0, capsys.readouterr().err
    assert "-> pruned" in capsys.readouterr().err
    trials = json.loads(out.read_text())["trials"]
    pruned = trials[1]
    assert [t["status"] for t in trials] == ["complete", "pruned"]
    assert pruned["params"]["train.lr"] == 1e-6 and pruned["steps"] == 4
    assert pruned["loss"] > first[0]["loss"]
    journal = optuna.load_study(study_name="hpsearch", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(study))))
    states = [t.state for t in journal.trials]
    assert states == [optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED]
    assert max(journal.trials[1].intermediate_values) == 4
    run_dir = tmp_path / "hp.runs" / "hpsearch" / "1"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] < 7 and not any("val_loss" in r for r in rows)
    assert not list(run_dir.glob("checkpoints/step_*"))


@pytest.mark.slow
def test_a_crashing_trial_is_reported_with_its_error_and_the_search_goes_on(
        data_cache, tmp_path, capsys, monkeypatch):
    """Step 2's loss is NaN in every trial: with train.max_skipped=1 the run stops with its
    one-line error, with 20 it skips the step and completes."""
    monkeypatch.setenv("MESHTRON_FAULTS", "nan:step=2")
    out = tmp_path / "hp.json"
    code = main(["hpsearch", *proxy_args(data_cache, steps=6), "--sampler", "grid",
                 "--space", "train.max_skipped=1,20", "--json", str(out),
                 "--trial-dir", str(tmp_path / "runs")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    trials = {t["params"]["train.max_skipped"]: t for t in json.loads(out.read_text())["trials"]}
    assert trials[20]["status"] == "complete" and trials[20]["steps"] == 6
    failed = trials[1]
    assert failed["status"] == "failed" and failed["loss"] is None
    assert failed["error"].startswith("exit ") and "train.max_skipped=1" in failed["error"]
    assert json.loads(out.read_text())["best"] == {"train.max_skipped": 20}
    assert "-> failed" in captured.err and "train.max_skipped=1" in captured.err


def test_an_interrupted_search_resumes_from_its_study_file(data_cache, tmp_path, capsys):
    """Ctrl-C in the middle of a trial: one line says how to resume; the same command then
    says what the file holds, fails the unfinished trial and runs its parameters again. With
    another space the file is refused in one line."""
    study = tmp_path / "hp.journal"
    args = ["hpsearch", *proxy_args(data_cache), "--space", "train.lr=0.002", "--study",
            str(study), "--json", str(tmp_path / "hp.json")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    # every step a second longer, so the trial is still running when Ctrl-C comes (a 10-step
    # trial of this model can finish between the poll that sees its metrics and the signal)
    env |= {"PYTHONPATH": str(ROOT), "MESHTRON_FAULTS": "slow:seconds=1"}
    proc = subprocess.Popen([sys.executable, "-m", "meshtron", *args], cwd=tmp_path, env=env,
                            stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "hp.runs" / "hpsearch" / "0" / "metrics.jsonl"
    while not metrics.exists():  # the trial's first step is done: nine slow ones are left
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err
    assert f"the same command resumes from {study}" in err
    assert main(args) == 0
    captured = capsys.readouterr()
    assert (f"resuming from {study}: 0 trials already done, 1 left running by an interruption"
            in captured.err), captured.err
    data = json.loads((tmp_path / "hp.json").read_text())
    states = [(t["number"], t["status"], t["params"]["train.lr"]) for t in data["trials"]]
    assert states == [(0, "failed", 0.002), (1, "complete", 0.002)]
    assert "interrupted" in data["trials"][0]["error"]
    other = [a if a != "train.lr=0.002" else "train.lr=0.002,0.004" for a in args]
    assert main(other) == 2
    assert "was run with other settings (space: ['train.lr=0.002'] -> " in one_error_line(capsys)


@pytest.mark.slow
def test_widths_run_the_same_points_and_report_each(data_cache, tmp_path, capsys):
    """--widths: the same grid at each width, a best per width, one curve per width."""
    out = tmp_path / "hp.json"
    code = main(["hpsearch", *proxy_args(data_cache, steps=8), "--model.mup=true",
                 "--model.mup_base_width=64", "--widths", "32,64", "--sampler", "grid",
                 "--space", "train.lr=0.003,0.0003", "--json", str(out), "--plot",
                 str(tmp_path / "lr.png"), "--output-config", str(tmp_path / "best.yaml")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(out.read_text())
    by_width = {w: sorted(t["params"]["train.lr"] for t in data["trials"] if t["width"] == w)
                for w in (32, 64)}
    assert by_width == {32: [0.0003, 0.003], 64: [0.0003, 0.003]}
    assert set(data["best_by_width"]) == {"32", "64"}
    best = min((t for t in data["trials"] if t["status"] == "complete"),
               key=lambda t: t["loss"])
    assert data["best"] == best["params"] and data["best_width"] == best["width"]
    assert "best at width 32:" in captured.out and "best at width 64:" in captured.out
    assert load_config(tmp_path / "best.yaml").model.hidden_size == 32  # the user's model
    assert (tmp_path / "lr.png").stat().st_size > 0


def test_dimension_describe_round_trips():
    for text in ("train.lr=0.0001:0.03:log", "train.global_batch=8,16", "train.steps=1:9"):
        assert parse_dimension(Dimension.describe(parse_dimension(text))) == \
            parse_dimension(text)
