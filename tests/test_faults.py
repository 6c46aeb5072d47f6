"""Faults caused for real (``MESHTRON_FAULTS``, signals from outside): a killed rank is named
and, with ``--max-restarts``, the group restarts from the newest checkpoint with the numbers of
an uninterrupted run; a NaN step is skipped on every rank; a slow rank is named a straggler; a
killed launcher takes its ranks with it."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed import HashStore

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.mesh.process import round_key
from meshtron.plan import plan_run
from meshtron.rank import build_rank
from meshtron.training import trainer as trainer_module
from meshtron.training.faults import Fault, FaultPlan, parse_faults
from meshtron.training.step import StepResult, train_step
from meshtron.training.trainer import Trainer, train
from meshtron.training.watchdog import Watchdog
from tests.parity import test_overrides
from tests.test_bad_input import one_error_line
from tests.test_cli import _JOB_VARIABLES
from tests.training_state import assert_same_state, snapshot


def _env(faults: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARIABLES and not k.startswith(("SLURM_", "MESHTRON_"))}
    env.update(OMP_NUM_THREADS="1", MESHTRON_FAULTS=faults)
    return env


def _train(data_cache: str, run: Path, *extra: str, faults: str = "", steps: int = 6,
           nproc: int = 2) -> subprocess.CompletedProcess:
    launcher = [o for o in extra if o.startswith(("--max-restarts", "--min-nproc"))]
    args = test_overrides(data_cache, str(run), steps) + [
        "--checkpoint.resume=true", "--checkpoint.every=2", "--train.log_every=1",
        *(o for o in extra if o not in launcher)]
    return subprocess.run([sys.executable, "-m", "meshtron", "train", "--nproc", str(nproc),
                           *launcher, *args], capture_output=True, text=True, timeout=300,
                          env=_env(faults), cwd=run.parent)


def _losses(run: Path) -> dict[int, float]:
    """Loss per step of the run's metrics.jsonl (events left out)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "event" not in row}


def test_fault_specs_are_parsed_and_bad_ones_refused(monkeypatch, capsys, data_cache, tmp_path):
    assert parse_faults("kill:rank=1:step=5; slow:rank=0:seconds=0.25") == [
        Fault("kill", 1, 5), Fault("slow", 0, None, 0.25)]
    plan = FaultPlan(1, {"MESHTRON_FAULTS": "nan:step=3;slow:seconds=0.5:rank=1"})
    assert plan.poison_loss(3) and not plan.poison_loss(4)
    assert plan.slow_seconds(7) == 0.5 and FaultPlan(0, {"MESHTRON_FAULTS": "slow:rank=1:"
                                                          "seconds=1"}).slow_seconds(7) == 0
    for spec, message in (("boom:step=1", "unknown fault 'boom'"),
                          ("kill:rank=1", "needs step=N"), ("nan:step=x", "is not a number"),
                          ("nan:when=3", "unknown setting 'when'")):
        monkeypatch.setenv("MESHTRON_FAULTS", spec)
        assert main(["train", *test_overrides(data_cache, str(tmp_path / "run"), 1)]) == 2
        assert message in one_error_line(capsys)


def test_injected_faults_wrap_the_loss_and_the_optimizer_of_their_step_only():
    """The step itself knows no faults: ``nan`` poisons the first loss of its step and ``slow``
    makes the step's last micro-batch end later (after its gradient reduction); other steps
    get the rank as it is, and the model's own loss is back after the step."""
    cfg = load_config(overrides=["--model.preset=tiny", "--model.vocab_size=256",
                                 "--model.num_layers=1", "--train.seq_len=8"])
    rank = build_rank(plan_run(cfg, 1), ParallelMesh.single())
    faults = FaultPlan(0, {"MESHTRON_FAULTS": "nan:step=2;slow:step=2:seconds=0.2"})
    window = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with faults.injected(1, rank) as clean:
        assert clean is rank
    with faults.injected(2, rank) as faulty:
        mb = faulty.split(window)
        losses = [float(faulty.model.loss_sum(faulty.model(mb.tokens), mb.targets).detach())
                  for _ in range(2)]
        seconds = []
        for last in (False, True):
            started = time.perf_counter()
            faulty.optimizer.begin_micro_batch(last=last)
            faulty.optimizer.end_micro_batch()
            seconds.append(time.perf_counter() - started)
    assert seconds[1] >= 0.2 > seconds[0] and faulty.model is rank.model
    assert faulty.optimizer.memory_bytes() == rank.optimizer.memory_bytes()  # its own otherwise
    assert math.isnan(losses[0]) and math.isfinite(losses[1])
    assert "loss_sum" not in vars(rank.model)


def test_max_restarts_needs_checkpoints_to_restart_from(data_cache, tmp_path, capsys):
    args = test_overrides(data_cache, str(tmp_path / "run"), 2)  # resume=false
    assert main(["train", "--max-restarts", "1", *args]) == 2
    assert "--max-restarts needs checkpoints to restart from" in one_error_line(capsys)
    assert main(["train", "--max-restarts", "-1", *args]) == 2
    assert "--max-restarts must not be negative" in one_error_line(capsys)


def test_each_rendezvous_round_meets_under_keys_of_its_own():
    """In the agent's store a failure bumps the restart count and a node that joins grows the
    world at the same count; in a store of their own the nodes' counts may differ."""
    def key(count: str, world: int, agent_store: bool = True) -> str:
        return round_key(world, {"TORCHELASTIC_RESTART_COUNT": count,
                                 "TORCHELASTIC_USE_AGENT_STORE": str(agent_store)})

    assert len({key("0", 2), key("0", 4), key("1", 2), key("1", 4)}) == 4
    assert key("1", 4, agent_store=False) == key("0", 4, agent_store=False) == "world_4"
    assert round_key(2, {}) == "world_2"  # SLURM or a plain MASTER_ADDR: one store per job


def test_a_nan_step_leaves_the_state_of_a_run_without_that_step(monkeypatch, tiny_overrides,
                                                                tmp_path):
    """Step 2's loss is NaN (fp16, loss-scaled): after 3 steps every parameter, fp32 master and
    Adam moment, the optimizer's step count and the loss scale equal those of a run in which
    step 2 was never computed (only told to the loss scaler as an overflow, which a NaN is to
    it); the step after the bad one sees the same state, so it gives the same loss."""
    monkeypatch.setenv("MESHTRON_FAULTS", "nan:step=2")
    small = ["--precision.dtype=fp16", "--train.steps=3", "--train.global_batch=2"]
    cfg = load_config(overrides=tiny_overrides + small)
    with_nan = Trainer(cfg, log=lambda m: None)
    nan_result = with_nan.run()

    monkeypatch.delenv("MESHTRON_FAULTS")
    steps = iter(range(1, 4))

    def never_computed(rank, batch, lr):
        if next(steps) != 2:
            return train_step(rank, batch, lr)
        rank.precision.scaler.update(overflow=True)
        return StepResult(math.nan, math.nan, skipped=True)

    monkeypatch.setattr(trainer_module, "train_step", never_computed)
    without = Trainer(load_config(overrides=[*tiny_overrides, f"--run.dir={tmp_path}/without",
                                             *small]),
                      log=lambda m: None)
    clean_result = without.run()
    assert with_nan.step == without.step == 3
    assert with_nan.skipped_steps == without.skipped_steps == 1
    assert math.isnan(nan_result.losses[1]) and not math.isfinite(nan_result.grad_norms[1])
    assert nan_result.losses[2] == clean_result.losses[2]
    state = snapshot(without)
    assert state["optimizer_steps"] == 2
    assert_same_state(state, snapshot(with_nan), "after a NaN step")


@pytest.mark.slow
def test_a_nan_step_is_skipped_everywhere_and_a_slow_rank_is_named(data_cache, tmp_path):
    run = tmp_path / "run"
    proc = _train(data_cache, run, "--run.straggler_every=3", "--checkpoint.every=1",
                  faults="nan:rank=1:step=2;slow:rank=1:seconds=0.4")
    assert proc.returncode == 0, proc.stderr
    assert "warning: step 2 skipped on every rank: loss nan; the weights and optimizer state " \
        "are unchanged" in proc.stderr
    assert "warning: straggler: rank 1 computed" in proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "event" not in row]
    assert [row["skipped_steps"] for row in steps] == [0, 1, 1, 1, 1, 1]
    assert [row["skipped"] for row in steps] == [False, True, False, False, False, False]
    events = [row for row in rows if row.get("event") == "straggler"]
    assert {row["rank"] for row in events} == {1} and {row["step"] for row in events} == {3, 6}
    for step_dir in sorted((run / "checkpoints").glob("step_*")):  # no NaN ever saved
        for tensor in load_file(str(step_dir / "shard-00000.safetensors")).values():
            assert tensor.is_floating_point() is False or bool(tensor.isfinite().all())
    assert math.isfinite(steps[-1]["loss"])


@pytest.mark.slow
def test_a_killed_rank_restarts_the_group_with_the_same_numbers(data_cache, tmp_path):
    killed = tmp_path / "killed"
    proc = _train(data_cache, killed, "--max-restarts=1", faults="kill:rank=1:step=4")
    assert proc.returncode == 0, proc.stderr
    assert ("meshtron: rank 1 was killed by SIGKILL; restarting every rank from the newest "
            "checkpoint (restart 1 of 1)") in proc.stderr
    assert "Traceback" not in proc.stderr and "resumed from" in proc.stdout, proc.stderr
    losses = _losses(killed)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    # Step 3 ran before the kill (its row was set aside by the resume) and again after it:
    # bit for bit the same, as every step after a restart is (same layout, same data order).
    first_try = [json.loads(line) for line in (killed / "metrics.replaced.jsonl").read_text()
                 .splitlines()]
    assert [row["step"] for row in first_try] == [3] and first_try[0]["loss"] == losses[3]

    blamed = tmp_path / "blamed"  # no restarts: the rank that died is the one named
    proc = _train(data_cache, blamed, faults="kill:rank=1:step=3")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "meshtron: error: rank 1 was killed by SIGKILL; the other ranks were stopped")


# Runs the launcher as the child of a subreaper (Linux's PR_SET_CHILD_SUBREAPER), so the ranks
# the killed launcher leaves behind become its children and their exit statuses can be read.
REAPER = """
import ctypes, os, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
launcher = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
while "step" not in (launcher.stdout.readline() or "step"):
    pass
launcher.kill()
launcher.wait()
codes = []
while True:
    try:
        codes.append(os.waitstatus_to_exitcode(os.wait()[1]))
    except ChildProcessError:
        print(codes)
        break
"""


@pytest.mark.slow
def test_a_killed_launcher_takes_its_ranks_with_it(data_cache, tmp_path):
    """Both ranks end by the SIGTERM their launcher's death sends (exit 143 through the signal
    handler, or -15 when it lands before the handler is installed or after it is removed);
    without it they would train on until a store operation of theirs failed (exit 1, ~20 s
    later)."""
    args = test_overrides(data_cache, str(tmp_path / "run"), 100_000) + ["--train.log_every=1"]
    reaper = subprocess.run([sys.executable, "-c", REAPER, sys.executable, "-m", "meshtron",
                             "train", "--nproc", "2", *args], capture_output=True, text=True,
                            env=_env(), cwd=tmp_path, timeout=300)
    codes = json.loads(reaper.stdout)
    assert len(codes) == 2 and set(codes) <= {143, -15}, (codes, reaper.stderr[-2000:])


HERE = {"host": socket.gethostname(), "pid": 4242}


@pytest.mark.parametrize(("beat", "cause", "killed"), [
    (lambda now: {"time": now - 60, "phase": "step 3", **HERE},
     "unresponsive: rank 1 (silent for 60 s, last in step 3)", [4242]),
    (lambda now: {"time": now - 60, "phase": "step 3", "host": "elsewhere", "pid": 4242},
     "unresponsive: rank 1 (silent for 60 s, last in step 3)", []),
    (lambda now: {"time": now, "phase": "step 4", **HERE},
     "a collective is stuck: rank 1 is in step 4", []),
    (lambda now: {"time": now, "phase": "step 3", **HERE}, "every rank answers and is in the "
     "same phase, which outlasts run.timeout_s=0.3: raise run.timeout_s above it", []),
], ids=["silent", "silent-on-another-host", "elsewhere", "slow-step"])
def test_the_watchdog_names_the_stalled_phase_and_the_silent_ranks(capsys, beat, cause, killed):
    """...and SIGKILLs the silent ranks on its own host, which would ignore the agent's
    SIGTERM and hold the job for its shutdown grace."""
    store = HashStore()
    store.set("heartbeat/1", json.dumps(beat(time.time())))
    exits: list[int] = []
    kills: list[int] = []
    exited = threading.Event()
    dog = Watchdog(0, 2, 0.3, store, exit_process=lambda code: (exits.append(code),
                                                                exited.set()),
                   kill_process=kills.append)
    dog.phase("step 3")
    dog.start()
    exited.wait(120)  # set by the watchdog's exit; the bound only stops a broken one hanging
    dog.stop()
    assert exits[:1] == [75] and kills[: len(killed)] == killed and set(kills) <= set(killed)
    line = capsys.readouterr().err.strip().splitlines()[0]
    assert line.startswith("meshtron: error: rank 0 waited 0 s in step 3 (run.timeout_s=0.3); ")
    assert line.endswith(cause), line
    assert json.loads(store.get("heartbeat/0"))["phase"] == "step 3"


@pytest.mark.slow
def test_a_stalled_rank_is_named_and_every_process_exits(data_cache, tmp_path):
    started = time.monotonic()
    proc = _train(data_cache, tmp_path / "run", "--run.timeout_s=6", faults="stall:rank=1:step=3")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert any(line.startswith("meshtron: error: rank 0 waited ") and " in step 3 " in line
               and "unresponsive: rank 1 (silent for" in line for line in lines), proc.stderr
    assert lines[-1] in (  # rank 0's watchdog SIGKILLs the stopped rank: it may be named
        "meshtron: error: rank 0 gave up waiting for stalled ranks (named in its line above); "
        "the other ranks were stopped",
        "meshtron: error: rank 1 was killed by SIGKILL; the other ranks were stopped")
    assert time.monotonic() - started < 6 + 60  # the timeout and start-up, no shutdown grace


@pytest.mark.slow
def test_a_lost_rank_continues_on_fewer_ranks_with_the_same_losses(data_cache, tmp_path):
    """4 ranks, rank 3 killed at step 4: the run continues on 2 (3 cannot split the batch of
    8), resharded from the step-2 checkpoint, and its losses are the 4-rank run's."""
    whole = tmp_path / "whole"
    assert _train(data_cache, whole, nproc=4).returncode == 0
    shrunk = tmp_path / "shrunk"
    proc = _train(data_cache, shrunk, "--max-restarts=1", "--min-nproc=2", nproc=4,
                  faults="kill:rank=3:step=4")
    assert proc.returncode == 0, proc.stderr
    assert ("meshtron: rank 3 was killed by SIGKILL; continuing on 2 ranks (was 4) from the "
            "newest checkpoint (restart 1 of 1)") in proc.stderr
    assert "saved under tp=1 cp=1 dp=4 pp=1, resharded to tp=1 cp=1 dp=2 pp=1" in proc.stdout
    expected, got = _losses(whole), _losses(shrunk)
    assert sorted(got) == sorted(expected) == [1, 2, 3, 4, 5, 6]
    for step in expected:
        assert abs(got[step] - expected[step]) <= 1e-4 * abs(expected[step]), step


def test_shrinking_stops_with_one_line_when_no_smaller_world_holds_the_layout(monkeypatch):
    """A restart on fewer ranks picks the largest world size the plan accepts; when none down
    to --min-nproc does, the run stops naming the failure and why it cannot continue."""
    from meshtron.errors import MeshtronError
    from meshtron.parallel.mesh import launch

    worlds: list[int] = []

    def failing_launch(nproc: int, train_args, command: str = "train") -> int:
        worlds.append(nproc)
        if nproc == 2:
            return 0
        raise launch.RankFailed(nproc - 1, "was killed by SIGKILL", 0)

    monkeypatch.setattr(launch, "_launch", failing_launch)
    assert launch.launch_local(8, [], max_restarts=3, min_nproc=2,
                               fits=lambda n: n % 2 == 0) == 0
    assert worlds == [8, 6, 4, 2]
    worlds.clear()
    with pytest.raises(MeshtronError, match=r"^rank 3 was killed by SIGKILL; the other ranks "
                       r"were stopped; no world size from 3 down to --min-nproc 3 holds this "
                       r"layout$"):
        launch.launch_local(4, [], max_restarts=3, min_nproc=3, fits=lambda n: n % 2 == 0)
    with pytest.raises(MeshtronError, match=r"^rank 6 was killed by SIGKILL \(after 1 "
                       r"restarts\); the other ranks were stopped$"):
        launch.launch_local(8, [], max_restarts=1, min_nproc=2, fits=lambda n: True)


@pytest.mark.slow
def test_a_crash_inside_a_save_resumes_from_the_checkpoint_before(data_cache, tmp_path):
    run = tmp_path / "run"
    proc = _train(data_cache, run, faults="save:step=4", nproc=1, steps=6)
    assert proc.returncode == -signal.SIGKILL  # killed with its shard written, not completed
    root = run / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002"]
    assert [p.name.split("-")[1] for p in root.glob(".tmp-step_*")] == ["step_00000004"]
    proc = _train(data_cache, run, nproc=1, steps=6)
    assert proc.returncode == 0, proc.stderr
    assert "ignoring" in proc.stderr and "a save that did not complete" in proc.stderr
    assert "step_00000002 at step 2" in proc.stdout


def test_checkpoints_by_time(data_cache, tmp_path):
    cfg = load_config(overrides=test_overrides(data_cache, str(tmp_path / "run"), 3) + [
        "--checkpoint.every=0", "--checkpoint.every_seconds=1e-9", "--checkpoint.keep_last=5"])
    train(cfg, log=lambda m: None)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == [
        "step_00000001", "step_00000002", "step_00000003"]
