"""The `meshtron` command line, run as a user runs it: a subprocess in a scratch directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from meshtron.data import IndexedDataset, open_source, preprocess, train_tokenizer
from tests.distributed import run_python
from tests.parity import test_overrides

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# A launcher's or scheduler's variables in the test's own environment would make a child
# think it is one rank of a bigger job.
_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def meshtron(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARIABLES and not k.startswith("SLURM_")}
    return run_python(["-m", "meshtron", *args], cwd, env, timeout)


def assert_user_error(proc: subprocess.CompletedProcess, fragment: str) -> str:
    """Non-zero exit, one line on stderr, 'meshtron: error: ...' holding ``fragment``."""
    assert proc.returncode != 0, f"exited 0; stdout:\n{proc.stdout}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    assert lines[0].startswith("meshtron: error: "), lines[0]
    assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def sample_text(paragraphs: int = 60) -> str:
    """Deterministic code-like text, enough for a few windows of 32 tokens."""
    lines = []
    for i in range(paragraphs):
        lines.append(f"def function_{i}(x, y={i}):\n    return x * y + {i % 7}  # step {i}\n")
    return "\n".join(lines)


def metrics_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows]


# ----------------------------------------------------------------------------- help


def test_top_level_help_lists_the_commands(tmp_path):
    proc = meshtron("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for command in ("train", "preprocess", "generate", "plot"):
        assert command in proc.stdout


def test_train_help_exits_zero_and_shows_every_section(tmp_path):
    proc = meshtron("train", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "--nproc" in proc.stdout and "--config" in proc.stdout
    for section in ("model", "parallel", "train", "data", "precision", "checkpoint", "run"):
        assert re.search(rf"^\s+{section}\b", proc.stdout, re.MULTILINE), section


def test_train_help_lists_dotted_config_names(tmp_path):
    proc = meshtron("train", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for name in ("model.preset", "parallel.tp", "train.global_batch", "checkpoint.dir"):
        assert name in proc.stdout, f"{name} not in `meshtron train --help`"


def test_config_errors_do_not_import_torch(tmp_path):
    script = ("import sys\n"
              "from meshtron.cli import main\n"
              "code = main(['train', '--train.stepz=3'])\n"
              "print(code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert "unknown config key 'train.stepz'" in proc.stderr
    assert proc.stdout.split() == ["2", "False"], "torch was imported to report a config error"


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_train_generate_plot_end_to_end(data_cache, tmp_path):
    run_dir = tmp_path / "run"
    proc = meshtron("train", *test_overrides(data_cache, str(run_dir), steps=6),
                    "--train.log_every=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    summary = re.search(r"trained steps 0\.\.6: loss ([\d.]+) -> ([\d.]+)", proc.stdout)
    assert summary, proc.stdout
    assert f"run directory: {run_dir}" in proc.stdout
    losses = metrics_losses(run_dir)
    assert len(losses) == 3  # steps 2, 4, 6
    assert float(summary.group(2)) == pytest.approx(losses[-1], abs=5e-5)

    proc = meshtron("generate", "--checkpoint", str(run_dir), "--prompt", "def ",
                    "--max-new-tokens", "20", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def "), proc.stdout
    assert len(proc.stdout.rstrip("\n")) > len("def ")  # something was generated
    assert f"checkpoint: {run_dir / 'checkpoints' / 'step_00000006'}" in proc.stderr

    proc = meshtron("generate", "--checkpoint", str(run_dir), "--prompt", "def ",
                    "--max-new-tokens", "1000", "--temperature", "0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "note: the model has 64 positions" in proc.stderr  # capped, and said so

    output = tmp_path / "plots" / "curve.png"
    proc = meshtron("plot", str(run_dir), "--output", str(output), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert output.read_bytes()[:8] == PNG_MAGIC
    assert str(output) in proc.stdout


def test_preprocess_txt_and_jsonl(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(sample_text())
    docs = ["first document, with some words", "second: def f(x): return x", "third café"]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prefix = tmp_path / "out" / "dataset"
    prefix.parent.mkdir()
    proc = meshtron("preprocess", str(text), str(jsonl), "--output", str(prefix),
                    "--cache-dir", str(tmp_path / "cache"), "--vocab-size", "300", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file()
    counts = re.search(r"^wrote .*: (\d+) documents, (\d+) tokens", proc.stdout, re.MULTILINE)
    assert counts, proc.stdout
    documents, tokens = int(counts.group(1)), int(counts.group(2))
    assert documents == 1 + len(docs)  # a .txt file is one document, a .jsonl line another
    dataset = IndexedDataset(prefix)
    assert len(dataset) == documents and dataset.total_tokens == tokens
    assert Path(f"{prefix}.bin").stat().st_size == 2 * tokens  # uint16 below 65500 tokens
    tokenizer = re.search(r"^tokenizer: (/\S+)$", proc.stdout, re.MULTILINE)
    assert tokenizer and Path(tokenizer.group(1)).is_file()
    assert Path(tokenizer.group(1)).is_relative_to(tmp_path / "cache")


# ----------------------------------------------------------------------------- bad input


def _truncated_dataset(tmp_path: Path) -> list[str]:
    """Preprocess a small corpus, then cut its .bin short; train on it."""
    text = tmp_path / "corpus.txt"
    text.write_text(sample_text())
    source = open_source(str(text))
    tokenizer = train_tokenizer(source, 300, tmp_path / "cache", log=lambda m: None)
    prefix = tmp_path / "dataset"
    preprocess([source], prefix, tokenizer, log=lambda m: None)
    binary = Path(f"{prefix}.bin")
    binary.write_bytes(binary.read_bytes()[:-10])
    return [f"--data.path={prefix}", f"--data.tokenizer={tokenizer.path}"]


def _empty_corpus(tmp_path: Path) -> list[str]:
    (tmp_path / "empty.txt").write_text("")
    return [f"--data.path={tmp_path / 'empty.txt'}"]


BAD_TRAIN_INPUTS: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "unknown-key": (lambda tmp: ["--train.stepz=3"],
                    "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
    "negative-batch": (lambda tmp: ["--train.global_batch=-8"],
                       "train.global_batch must be a positive integer, got -8"),
    "seq-len-too-long": (lambda tmp: ["--train.seq_len=128"],
                         "train.seq_len=128 exceeds the model's positions"),
    "missing-data-path": (lambda tmp: ["--data.path=/nonexistent.txt"],
                          "data path not found: /nonexistent.txt"),
    "empty-corpus": (_empty_corpus, "holds no text"),
    "truncated-bin": (_truncated_dataset, "truncated"),
    "missing-config": (lambda tmp: ["--config", str(tmp / "missing.yaml")],
                       "config file not found"),
}


@pytest.mark.parametrize("case", list(BAD_TRAIN_INPUTS))
def test_bad_train_input_is_one_clear_line(data_cache, tmp_path, case):
    make_args, fragment = BAD_TRAIN_INPUTS[case]
    run_dir = tmp_path / "run"
    args = test_overrides(data_cache, str(run_dir), steps=2) + make_args(tmp_path)
    proc = meshtron("train", *args, cwd=tmp_path)
    assert_user_error(proc, fragment)
    assert not (run_dir / "metrics.jsonl").exists()


def test_layout_error_is_raised_before_any_process_starts(data_cache, tmp_path, monkeypatch,
                                                         capsys):
    """The command's one line and exit code 2; and, in this process with the launcher
    replaced by one that records its calls, no launch at all (a bound on the command's
    seconds told the same on an idle machine only)."""
    args = ["train", "--nproc", "3", "--parallel.tp=2",
            *test_overrides(data_cache, str(tmp_path / "run"), steps=2)]
    proc = meshtron(*args, cwd=tmp_path)
    assert_user_error(proc, "world size 3 is not divisible by tp*cp*pp")
    assert not (tmp_path / "run").exists()
    from meshtron import cli
    from meshtron.parallel.mesh import launch

    launched: list[tuple] = []
    monkeypatch.setattr(launch, "launch_local", lambda *a, **k: launched.append(a) or 0)
    assert cli.main(args) == 2 and launched == []
    assert "world size 3 is not divisible by tp*cp*pp" in capsys.readouterr().err
    # the same command with a layout that fits reaches the launcher, which is what is watched
    assert cli.main(["train", "--nproc", "2", *args[4:]]) == 0 and len(launched) == 1


def test_generate_from_a_missing_checkpoint(tmp_path):
    proc = meshtron("generate", "--checkpoint", "/nonexistent", "--prompt", "x", cwd=tmp_path)
    assert_user_error(proc, "checkpoint path not found: /nonexistent")


# ----------------------------------------------------------------------------- several ranks


@pytest.mark.slow
def test_multi_process_failure_exits_promptly_naming_the_rank(data_cache, tmp_path):
    """The launcher stops the rank that did not fail (its line says so), rather than leaving
    it in a collective until run.timeout_s (600 s by default): the bound on the seconds is
    half that, far above any start-up on a loaded machine (60 s was not)."""
    started = time.monotonic()
    proc = meshtron("train", "--nproc", "2",
                    *test_overrides(data_cache, str(tmp_path / "run"), steps=2),
                    "--data.path=/nonexistent.txt", cwd=tmp_path, timeout=400)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert "data path not found: /nonexistent.txt" in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert re.match(r"meshtron: error: rank \d+ exited with code \d+; the other ranks were "
                    r"stopped$", lines[-1]), proc.stderr
    assert elapsed < 300


@pytest.mark.slow
def test_multi_process_data_error_shows_no_traceback(data_cache, tmp_path):
    proc = meshtron("train", "--nproc", "2",
                    *test_overrides(data_cache, str(tmp_path / "run"), steps=2),
                    "--data.path=/nonexistent.txt", cwd=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "data path not found: /nonexistent.txt" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_two_process_tensor_parallel_matches_one_process(data_cache, tmp_path):
    losses = {}
    for nproc in (1, 2):
        run_dir = tmp_path / f"np{nproc}"
        layout = ["--nproc", "2", "--parallel.tp=2"] if nproc == 2 else []
        proc = meshtron("train", *layout, *test_overrides(data_cache, str(run_dir), steps=5),
                        "--train.log_every=1", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        losses[nproc] = metrics_losses(run_dir)
    assert len(losses[1]) == len(losses[2]) == 5
    for step, (a, b) in enumerate(zip(losses[1], losses[2], strict=True), start=1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: tp=2 loss {b!r}, one process {a!r}"
