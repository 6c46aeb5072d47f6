"""Environment faults caused for real: read-only directories, a file system that refuses a
save, a file where a checkpoint directory would go, a second training on a busy run directory.
Each ends in one ``meshtron: error:`` line, before training where it can be known then."""

from __future__ import annotations

import ctypes
import os
import resource
import socket
import subprocess
import sys

import pytest

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.training import run_lock
from meshtron.training.trainer import Trainer
from tests.parity import test_overrides
from tests.test_bad_input import one_error_line

PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def _without_root_override() -> None:
    """Root ignores permission bits: the child drops the capabilities that let it (from its
    bounding set, so they are gone after exec) and meets the bits as any user would."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory this user may read but not write."""
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    yield read_only
    read_only.chmod(0o755)


@pytest.mark.parametrize("where", ["run.dir", "checkpoint.dir"])
def test_a_read_only_output_directory_is_refused_before_training(data_cache, read_only_dir,
                                                                 where):
    args = test_overrides(data_cache, str(read_only_dir.parent / "run"), 2)
    args.append(f"--{where}={read_only_dir / 'out'}")
    proc = subprocess.run([sys.executable, "-m", "meshtron", "train", *args],
                          capture_output=True, text=True, timeout=120, cwd=read_only_dir.parent,
                          preexec_fn=_without_root_override)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == (f"meshtron: error: {where} {read_only_dir / 'out'} is not writable "
                        "(permission denied)")
    assert "dataset:" not in proc.stdout  # refused before the data was even looked at


def test_a_file_named_like_a_checkpoint_is_refused_up_front(data_cache, tmp_path, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_00000002").write_text("not a checkpoint")
    assert main(["train", *test_overrides(data_cache, str(tmp_path / "run"), 2)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"meshtron: error: {tmp_path}/run/checkpoints/step_00000002 is a file named "
                   "like a checkpoint directory; move it out of checkpoint.dir"]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_save_the_file_system_refuses_says_what_is_kept(data_cache, tmp_path, asynchronous):
    """A size limit on files (RLIMIT_FSIZE: writes fail with EFBIG, as on a full disk) makes
    the second save fail: one line naming the reason and the checkpoint that survives."""
    cfg = load_config(overrides=test_overrides(data_cache, str(tmp_path / "run"), 1)
                      + [f"--checkpoint.async={str(asynchronous).lower()}"])
    trainer = Trainer(cfg, log=lambda m: None)
    trainer.step = 1
    trainer.save()
    trainer.saver.wait()
    trainer.step = 2
    root = tmp_path / "run" / "checkpoints"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(MeshtronError) as caught:
            trainer.save()
            trainer.saver.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(caught.value) == (
        f"saving the checkpoint of step 2 under {root} failed (file size limit exceeded); the "
        f"newest complete checkpoint, {root / 'step_00000001'}, is kept")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]


def test_metrics_the_file_system_refuses_are_one_line(data_cache, tmp_path, capsys):
    """metrics.jsonl at the file-size limit: the first row's write fails (EFBIG)."""
    run = tmp_path / "run"
    run.mkdir()
    limit = 3 << 20
    row = '{"step": 0, "loss": 0.0}\n'
    (run / "metrics.jsonl").write_text(row * (limit // len(row) + 1))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        code = main(["train", *test_overrides(data_cache, str(run), 1)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"meshtron: error: cannot write the metrics of step 1 to {run} "
                                 "(file size limit exceeded)"], err


HOLD = """
import sys
from pathlib import Path
from meshtron.training.run_lock import run_lock
with run_lock(Path(sys.argv[1]), Path(sys.argv[2])):
    print("held", flush=True)
    sys.stdin.read()  # held until the test kills this process, however long its checks take
"""


def test_a_second_training_on_a_busy_directory_is_refused_naming_the_holder(data_cache, tmp_path,
                                                                          capsys):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != run_lock.HELD_ENV}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run), str(run / "checkpoints")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        busy = f"(pid {holder.pid} on host {socket.gethostname()}, since "
        assert main(["train", *test_overrides(data_cache, str(run), 1)]) == 2
        line = one_error_line(capsys)
        assert line.startswith(f"meshtron: error: run.dir {run} is in use by another training "
                               + busy) and line.endswith("or use another run.dir"), line
        other = test_overrides(data_cache, str(tmp_path / "other"), 1)
        assert main(["train", *other, f"--checkpoint.dir={run / 'checkpoints'}"]) == 2
        assert f"checkpoint.dir {run / 'checkpoints'} is in use by another training " + busy \
            in one_error_line(capsys)
    finally:
        holder.kill()
        holder.wait()
    assert main(["train", *test_overrides(data_cache, str(run), 1)]) == 0  # released by the kernel
    assert os.environ.get(run_lock.HELD_ENV) is None
