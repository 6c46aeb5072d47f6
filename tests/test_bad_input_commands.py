"""Unseen inputs of issue 51 to the commands (generate, plot, convert, preprocess, train):
each ends in one `meshtron: error:` line, without a hang or a traceback, or in the right
success."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import yaml

from meshtron.cli import main
from tests.parity import run_training, test_overrides
from tests.test_bad_input import one_error_line
from tests.test_bad_input_unseen import end_a_blocked_read


@pytest.fixture(scope="module")
def run(data_cache, tmp_path_factory) -> Path:
    """A tiny run trained one step, with its checkpoint."""
    path = tmp_path_factory.mktemp("unseen") / "run"
    run_training(test_overrides(data_cache, str(path), steps=1))
    return path


def generate(run: Path, *args: str) -> list[str]:
    return ["generate", "--checkpoint", str(run), "--max-new-tokens", "2", *args]


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt", "\udcff\udcfe def"], "--prompt is not UTF-8 text (byte 0xff at character 1)"),
    (["--prompt", "a", "--prompt", "b\udcff"], "--prompt 2 is not UTF-8 text"),
    (["--stop", ""], "--stop is empty: a stop string must be non-empty text"),
    (["--stop", "x", "--stop", ""], "--stop 2 is empty"),
])
def test_generate_refuses_bytes_and_empty_stops_before_loading(tmp_path, capsys, args, message):
    assert main(generate(tmp_path / "no-such-run", *args)) == 2  # refused before the path
    assert message in one_error_line(capsys)


def test_generate_refuses_a_prompt_file_that_is_a_fifo(run, tmp_path, capsys):
    fifo = tmp_path / "prompts"
    os.mkfifo(fifo)  # no writer: reading it would wait forever
    threading.Thread(target=end_a_blocked_read, args=(fifo,), daemon=True).start()
    assert main(generate(run, "--prompt-file", str(fifo))) == 2
    assert f"--prompt-file {fifo} is not a regular file" in one_error_line(capsys)


def test_generate_refuses_a_run_whose_newest_checkpoint_is_another_model(run, tmp_path,
                                                                          capsys):
    other = tmp_path / "run"
    shutil.copytree(run, other)
    saved = yaml.safe_load((other / "config.yaml").read_text())
    saved["model"]["hidden_size"] *= 2  # the run trained a wider model than this checkpoint's
    (other / "config.yaml").write_text(yaml.safe_dump(saved))
    assert main(generate(other)) == 2
    line = one_error_line(capsys)
    assert "holds another model than the run" in line and "model.hidden_size: 128 -> 64" in line
    checkpoint = next((other / "checkpoints").glob("step_*"))
    assert main(generate(checkpoint, "--json")) == 0  # named itself, it generates
    assert main(generate(run, "--json")) == 0
