"""Ctrl-C and SIGTERM stop `meshtron train` with one line and exit 130 / 143, never a traceback.

The run is a real subprocess in its own process group, stopped once it has logged a few steps:
a terminal's Ctrl-C reaches the whole foreground group (``os.killpg``), a scheduler's SIGTERM
the launcher's pid (``os.kill``).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import typing
import weakref
from pathlib import Path

import pytest

from meshtron.checkpoint.store import LATEST, MANIFEST
from meshtron.signals import Stopped, reports_stop, stop_on_signals
from tests.parity import test_overrides

_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
STEP_LINE = re.compile(r"step\s+(\d+)/")


def stop_training(args: list[str], sig: int, *, group: bool, cwd: Path,
                  after_step: int = 3) -> tuple[int, str, str]:
    """Start `meshtron train ARGS`, send ``sig`` once it has logged ``after_step``, and return
    (exit code, stdout, stderr). Nothing waits without a timeout."""
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARIABLES and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"  # else torchrun prints a banner about it at start-up
    proc = subprocess.Popen([sys.executable, "-m", "meshtron", "train", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()
    out: list[str] = []
    err: list[str] = []

    def pump(stream: typing.IO[str], into: list[str], notify: bool) -> None:
        for line in stream:
            into.append(line)
            if notify:
                lines.put(line)
        if notify:
            lines.put(None)

    readers = [threading.Thread(target=pump, args=(proc.stdout, out, True), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, err, False), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        while True:
            try:
                line = lines.get(timeout=90)
            except queue.Empty:
                pytest.fail(f"no step {after_step} within 90 s:\n{''.join(out + err)}")
            if line is None:
                pytest.fail(f"the run ended before step {after_step}:\n{''.join(out + err)}")
            match = STEP_LINE.match(line)
            if match and int(match.group(1)) >= after_step:
                break
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    return code, "".join(out), "".join(err)


def assert_one_stop_line(code: int, out: str, err: str, sig: int) -> str:
    assert code == 128 + sig, f"exit code {code}\nstdout:\n{out}\nstderr:\n{err}"
    assert "Traceback" not in out + err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith(f"meshtron: stopped by {signal.Signals(sig).name}"), lines[0]
    assert "checkpoints are kept" in lines[0] and "resumes" in lines[0], lines[0]
    return lines[0]


def run_args(data_cache: str, run_dir: Path) -> list[str]:
    """A run far longer than the test, saving every step; a given peak spares the start-up
    matmul that measures one."""
    return [*test_overrides(data_cache, str(run_dir), steps=100000), "--train.log_every=1",
            "--checkpoint.every=1", "--train.peak_flops=1e12"]


@pytest.mark.parametrize(("sig", "group"), [
    pytest.param(signal.SIGTERM, False, id="sigterm"),
    pytest.param(signal.SIGINT, True, id="ctrl-c", marks=pytest.mark.slow),  # as SIGTERM, 130
])
def test_a_signal_stops_a_run_with_one_line(data_cache, tmp_path, sig, group):
    run_dir = tmp_path / "run"
    code, out, err = stop_training(run_args(data_cache, run_dir), sig, group=group, cwd=tmp_path)
    assert_one_stop_line(code, out, err, sig)
    checkpoints = run_dir / "checkpoints"
    newest = checkpoints / (checkpoints / LATEST).read_text().strip()
    assert (newest / MANIFEST).is_file(), f"{newest} is not a complete checkpoint"


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "group"), [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c", "sigterm-to-launcher"])
def test_a_signal_stops_a_two_process_run_with_one_line(data_cache, tmp_path, sig, group):
    code, out, err = stop_training(["--nproc", "2", *run_args(data_cache, tmp_path / "run")],
                                   sig, group=group, cwd=tmp_path)
    assert_one_stop_line(code, out, err, sig)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_stop_handlers_raise_in_the_main_thread_and_are_restored(sig, code):
    before = signal.getsignal(sig)
    with pytest.raises(Stopped) as caught, stop_on_signals() as received:
        os.kill(os.getpid(), sig)  # the handler runs before the next bytecode
        pytest.fail("no Stopped was raised")
    assert caught.value.exit_code == code and received.signum == sig
    assert signal.getsignal(sig) is before
    ctrl_c = " (Ctrl-C)" if sig == signal.SIGINT else ""
    assert caught.value.line(training=False) == f"meshtron: stopped by {sig.name}{ctrl_c}"


def test_a_stop_the_garbage_collector_swallows_is_recorded_without_a_traceback(monkeypatch):
    """The CI once saw a rank print 'Exception ignored ... Stopped: SIGTERM' with a traceback:
    the agent's SIGTERM landed in a weak-reference callback while the rank was cleaning up."""

    class Finalised:
        pass

    printed: list[BaseException | None] = []  # what Python would print as "Exception ignored"
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: printed.append(
        unraisable.exc_value))
    with stop_on_signals() as received:
        thing = Finalised()
        sent = weakref.ref(thing, lambda _: os.kill(os.getpid(), signal.SIGTERM))
        del thing  # the callback runs here, and the handler raises inside it
        assert sent() is None and received.signum == signal.SIGTERM
        with pytest.raises(Stopped):  # armed still: the next signal stops the command
            os.kill(os.getpid(), signal.SIGTERM)
        received.disarm()  # the command has its result: signals are only recorded
        os.kill(os.getpid(), signal.SIGINT)
    assert printed == []


def test_only_one_process_of_a_job_reports_the_stop():
    assert reports_stop({})
    assert reports_stop({"RANK": "0"}) and not reports_stop({"RANK": "1"})
    assert not reports_stop({"SLURM_PROCID": "3"})
    assert not reports_stop({"RANK": "0", "TORCHELASTIC_RUN_ID": "x"})  # the agent reports it
