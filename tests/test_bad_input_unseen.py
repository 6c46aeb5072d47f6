"""Unseen inputs of issue 51 that ended badly (a traceback, a hang, a silent wrong success or
a misleading line): config values and files. Each now ends in one `meshtron: error:` line
before anything runs, or in the right success."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.config.checks import inert_settings
from meshtron.errors import MeshtronError
from tests.test_bad_input import one_error_line


@pytest.mark.parametrize(("override", "message"), [
    ("--train.seed=18446744073709551616", "train.seed must fit in 64 bits"),
    ("--train.seed=-9223372036854775809", "train.seed must fit in 64 bits"),
    ("--run.dir=" + "x" * 5000, "run.dir is 5,000 bytes long; a path may have at most 4,095"),
    ("--run.dir=runs/" + "x" * 300, "run.dir has a name of 300 bytes"),
    ("--checkpoint.dir=" + "y" * 256, "checkpoint.dir has a name of 256 bytes"),
    ("--run.dir=", "run.dir is empty"),
    ("--checkpoint.dir=", "checkpoint.dir is empty"),
    ("--data.cache_dir=", "data.cache_dir is empty"),
    ("--parallel.tp_comm_chunks=0", "parallel.tp_comm_chunks must be a positive integer"),
    ("--data.vocab_size=1000000000", "data.vocab_size=1000000000 is beyond any model"),
])
def test_unseen_config_values_are_refused(override, message):
    with pytest.raises(MeshtronError, match=message):
        load_config(overrides=[override])


def test_the_largest_seeds_are_accepted():
    assert load_config(overrides=[f"--train.seed={2**64 - 1}"]).train.seed == 2**64 - 1
    assert load_config(overrides=[f"--train.seed={-(2**63)}"]).train.seed == -(2**63)


def test_an_empty_run_dir_trains_nothing_into_the_current_folder(tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--run.dir="]) == 2
    assert "run.dir is empty" in one_error_line(capsys)
    assert list(tmp_path.iterdir()) == []


def test_sequence_parallelism_at_tp_1_is_said_to_do_nothing():
    assert inert_settings(load_config(overrides=["--parallel.sp=true"])) == [
        "parallel.sp=true has no effect at parallel.tp=1 (sequence parallelism splits the "
        "residual stream over tp ranks)"]
    assert inert_settings(load_config(overrides=["--parallel.sp=true", "--parallel.tp=2"])) == []


def test_train_says_the_note_once(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--parallel.sp=true", "--max-restarts=1",  # refused after the note
                 "--checkpoint.every=0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("note: parallel.sp=true has no effect at parallel.tp=1 (sequence "
                      "parallelism splits the residual stream over tp ranks)")
    assert len(err) == 2 and err[1].startswith("meshtron: error: --max-restarts needs")


def test_two_config_files_are_refused_not_half_dropped(tmp_path, capsys):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("train:\n  steps: 3\n")
    b.write_text("train:\n  lr: 0.01\n")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", str(a), "--config", str(b)])
    assert exit_.value.code == 2
    line = one_error_line(capsys)
    assert f"--config: given twice ({a}, then {b})" in line


@contextlib.contextmanager
def a_reader_gets_eof(fifo: Path) -> Iterator[None]:
    """Should the code under test open ``fifo`` to read (the bug), a writer thread opens its
    other end at that moment and closes it, so the read ends at EOF instead of hanging the
    suite (the test then fails on the message). Opening for writing blocks until a reader
    comes; on leaving, this side holds the read end open until the thread has joined (a
    reader that opened and closed before the thread reached its open would leave it blocked)."""
    writer = threading.Thread(target=lambda: os.close(os.open(fifo, os.O_WRONLY)), daemon=True)
    writer.start()
    try:
        yield
    finally:
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        writer.join()
        os.close(reader)


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_config_that_is_not_a_regular_file_says_so(tmp_path, kind):
    # /dev/null stands for /dev/zero (the same check), which a bug would read until memory ends
    path = {"fifo": tmp_path / "pipe.yaml", "device": Path("/dev/null"),
            "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # no writer: reading it would block forever
    what = "is a directory" if kind == "directory" else "is not a regular file"
    guard = a_reader_gets_eof(path) if kind == "fifo" else contextlib.nullcontext()
    with guard, pytest.raises(MeshtronError, match=f"config file {path} {what}"):
        load_config(path)


def test_a_yaml_merge_key_merges(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train: &base\n  steps: 3\n  lr: 0.01\n"
                    "checkpoint:\n  every: 2\n"
                    "run:\n  <<: {progress: false, plot: false}\n  plot: true\n")
    cfg = load_config(path)
    assert cfg.train.steps == 3 and cfg.run.progress is False and cfg.run.plot is True
    path.write_text("run:\n  <<: {progress: false}\n  plot: true\n  plot: false\n")
    with pytest.raises(MeshtronError, match="key 'plot' given twice"):
        load_config(path)


def test_a_data_file_with_a_comma_in_its_name(tmp_path):
    cfg = load_config(overrides=[r"--data.path=a\,b.txt,0.5:c.txt"])
    assert cfg.data.path == ["a,b.txt", "0.5:c.txt"]
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  path:\n    - a,b.txt\n")
    assert load_config(path).data.path == ["a,b.txt"]


def test_caches_follow_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert load_config().data.cache_dir == str(tmp_path / "xdg" / "meshtron")
    assert load_config(overrides=["--data.cache_dir=/c"]).data.cache_dir == "/c"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not absolute: ignored, as XDG says
    assert load_config().data.cache_dir == "~/.cache/meshtron"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert load_config().data.cache_dir == "~/.cache/meshtron"


def test_train_help_wraps_to_the_terminal_and_ends_with_examples(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "72")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out.rstrip().splitlines()
    examples = out.index("examples:")
    assert all(len(line) <= 72 for line in out[:examples]), max(out[:examples], key=len)
    assert out[-1].lstrip().startswith(("meshtron train", "torchrun"))
    assert any("--parallel.tp=" in line for line in out[examples:])


def test_a_deleted_working_folder_is_one_line(tmp_path, capsys, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert main(["train", "--train.steps=1"]) == 2
    assert "the current folder no longer exists" in one_error_line(capsys)


@pytest.mark.parametrize("command", [
    ["generate", "--checkpoint", "LONG"], ["plot", "LONG"], ["convert", "--from", "LONG",
                                                             "--to", "out"],
    ["preprocess", "LONG", "--output", "out/p"], ["generate", "--checkpoint", ".",
                                                   "--prompt-file", "LONG"],
])
def test_a_path_with_a_name_too_long_is_one_short_line(tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    assert main([arg.replace("LONG", "z" * 5000) for arg in command]) == 2
    line = one_error_line(capsys)
    assert line.endswith("a name in the path is longer than the file system allows"), line
    assert len(line) < 300


def test_a_fifo_as_data_tokenizer_or_convert_source_says_what_it_is(tmp_path, capsys):
    """A named pipe given where a file is read used to be called empty ("holds no text"),
    missing ("tokenizer not found") or "a parent is a file"; and a run refused for its data
    left an empty run directory with a lock file behind."""
    from meshtron.data import open_source
    from meshtron.data.tokenizer import Tokenizer
    from tests.test_cli import meshtron

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # no writer: a read would block, so each check must stat, not open
    with a_reader_gets_eof(fifo):
        with pytest.raises(MeshtronError, match=f"data path {fifo} is a named pipe"):
            open_source(str(fifo))
        with pytest.raises(MeshtronError, match=f"tokenizer {fifo} is a named pipe"):
            Tokenizer.load(fifo)
        assert main(["convert", "--from", str(fifo), "--to", str(tmp_path / "out"),
                     "--format", "hf"]) == 2
        assert f"--from {fifo} is a named pipe" in one_error_line(capsys)
        run = tmp_path / "runs" / "refused"
        proc = meshtron("train", f"--data.path={fifo}", f"--run.dir={run}",
                        "--train.steps=1", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"meshtron: error: data path {fifo} is a named pipe (FIFO), not a file or folder of "
        "text"], proc.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


def test_a_device_as_a_plot_output_is_refused(tmp_path, capsys):
    """``plot --output /dev/full`` wrote /dev/full.png (the suffix rule) and exited 0."""
    from meshtron.files import png_path

    with pytest.raises(MeshtronError, match="/dev/full is a character device; name a PNG"):
        png_path("/dev/full", "loss.png")
    assert main(["schedule", "--pp", "2", "--microbatches", "2", "--out", "/dev/null"]) == 2
    assert "/dev/null is a character device" in one_error_line(capsys)
    assert png_path(str(tmp_path), "loss.png") == tmp_path / "loss.png"
