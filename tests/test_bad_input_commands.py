"""Unseen inputs of issue 51 to the commands (generate, plot, convert, preprocess, train):
each ends in one `meshtron: error:` line, without a hang or a traceback, or in the right
success."""

from __future__ import annotations

import os
import resource
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from meshtron.cli import main
from tests.parity import run_training, test_overrides
from tests.test_bad_input import one_error_line
from tests.test_bad_input_unseen import a_reader_gets_eof


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
    with a_reader_gets_eof(fifo):
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


TUNE = ["tune", "--model.preset=tiny", "--cluster.gpu=h100-sxm", "--cluster.gpus=8"]


@pytest.mark.parametrize(("args", "message"), [
    (["--top", "0"], "--top must be at least 1 (rows of the table), got 0"),
    (["--top", "-2"], "--top must be at least 1 (rows of the table), got -2"),
    (["--tokens", "-5"], "--tokens must be a positive number of tokens to train on, got -5"),
    (["--tokens", "nan"], "--tokens must be a positive number"),
    (["--output-config", "no/such/dir/x.yaml"],
     "--output-config no/such/dir/x.yaml: the folder no/such/dir does not exist"),
    (["--json", "."], "--json . is a folder; name a file"),
])
def test_tune_refuses_its_table_arguments_before_the_table(tmp_path, capsys, monkeypatch, args,
                                                            message):
    monkeypatch.chdir(tmp_path)
    assert main([*TUNE, *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before the table
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize(("args", "message"), [
    (["--budget-flops", "1e12", "--budget-gpu-hours", "3"],
     "give only one of --budget-flops and --budget-gpu-hours"),
    (["--budget-flops", "1e40"], "--budget-flops 1e+40 is beyond any training run (at most "
                                 "1e+30): a typo?"),
    (["--budget-gpu-hours", "1e40", "--cluster.gpu=h100-sxm", "--cluster.gpus=8"],
     "--budget-gpu-hours 1e+40 buys"),
    (["--budget-flops", "1e29", "--data.vocab_size=512"],
     "more than a run may have (1e+12); lower the budget, or give --proxy-steps or --law"),
])
def test_archsearch_refuses_budgets_before_any_proxy(tmp_path, capsys, args, message):
    assert main(["archsearch", *args, f"--data.cache_dir={tmp_path / 'cache'}"]) == 2
    assert message in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "cache" / "scratch").exists()  # no proxy was started


def test_scratch_goes_under_the_cache_and_is_removed(tmp_path, monkeypatch):
    from meshtron.config import load_config
    from meshtron.data.cache import scratch

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with scratch(load_config().data.cache_dir, "archsearch-") as folder:
        assert Path(folder).parent == tmp_path / "xdg" / "meshtron" / "scratch"
        assert Path(folder).name.startswith("archsearch-")
    assert not Path(folder).exists()


def test_hpsearch_plot_shows_pruned_trials(tmp_path):
    from meshtron.hpsearch.ranking import Row, curves, plot_series

    rows = [Row(0, None, {"train.lr": 1e-3}, 2.0, "complete"),
            Row(1, None, {"train.lr": 3e-3}, 1.8, "complete"),
            Row(2, None, {"train.lr": 1e-2}, 3.5, "pruned", steps=4),
            Row(3, None, {"train.lr": 3e-2}, None, "failed")]
    assert curves(rows, "train.lr", "pruned") == {"trials": [(1e-2, 3.5)]}
    drawn = []
    for pruned in (None, curves(rows, "train.lr", "pruned")):
        path = tmp_path / f"{len(drawn)}.png"
        plot_series(curves(rows, "train.lr"), path, "train.lr", "t", True, pruned=pruned)
        drawn.append(path.read_bytes())
    assert drawn[0] != drawn[1]  # the pruned trial is drawn


def test_plot_to_a_file_that_is_not_an_image_is_refused_up_front(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    assert main(["plot", str(run), "--output", str(tmp_path / "curve.txt")]) == 2
    assert ".txt is not an image format; use one of .png, .pdf, .svg" in one_error_line(capsys)
    assert main(["plot", str(run), "--output", str(tmp_path / "curve.svg")]) == 0
    assert (tmp_path / "curve.svg").read_text().lstrip().startswith("<?xml")


def test_plot_of_losses_near_the_float_limit_draws_the_rest(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step":1,"loss":1e308}\n{"step":2,"loss":-1e308}\n'
                                       '{"step":3,"loss":2.5}\n{"step":4,"loss":2.0}\n')
    assert main(["plot", str(run)]) == 0
    assert (run / "loss.png").is_file()
    (run / "metrics.jsonl").write_text('{"step":1,"loss":1e308}\n{"step":2,"loss":-1e308}\n')
    assert main(["plot", str(run)]) == 2
    assert "holds no rows with an integer step and a finite loss" in one_error_line(capsys)


def test_preprocess_refuses_a_vocabulary_no_tokenizer_can_allocate(tmp_path, capsys,
                                                                   monkeypatch):
    text = tmp_path / "a.txt"
    text.write_text("hello world\nfoo bar\n")
    out = str(tmp_path / "out" / "p")
    assert main(["preprocess", str(text), "--output", out, "--vocab-size", "1000000000"]) == 2
    assert "--vocab-size 1000000000 is outside what a trained tokenizer may have (257 to " \
           "16,777,216)" in one_error_line(capsys)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # and the cache follows XDG
    assert main(["preprocess", str(text), "--output", out, "--vocab-size", "300"]) == 0
    assert list((tmp_path / "xdg" / "meshtron" / "tokenizers").glob("*/tokenizer.json"))


def test_an_export_the_file_system_refuses_is_one_line_and_leaves_nothing(run, tmp_path,
                                                                          capsys):
    """A real refusal by the OS: a file size limit below the weights' size (EFBIG, as a full
    disk's ENOSPC, inside safetensors' writer); SIGXFSZ ignored so that the write fails
    instead of the process."""
    out = tmp_path / "out"
    out.mkdir()
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        code = main(["convert", "--from", str(run), "--to", str(out / "hf"), "--format", "hf"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert code == 2
    line = one_error_line(capsys)
    assert f"writing {out / 'hf'} failed (file size limit exceeded); nothing was left" in line
    assert list(out.iterdir()) == []  # no .tmp-hf-* folder
    assert main(["convert", "--from", str(run), "--to", str(out / "hf"), "--format", "hf"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["hf"]
