"""Inputs found by an adversarial pass that used to pass validation and crash later (or be
silently ignored): each now ends in one `meshtron: error:` line before anything runs."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.errors import MeshtronError

CONFIG_VALUES = [
    ("--train.beta1=1.5", "train.beta1 must lie in [0, 1)"),
    ("--train.beta2=1.0", "train.beta2 must lie in [0, 1)"),
    ("--train.beta2=-0.1", "train.beta2 must lie in [0, 1)"),
    ("--train.eps=-1e-8", "train.eps must be positive"),
    ("--train.eps=0", "train.eps must be positive"),
    ("--model.init_std=-0.02", "model.init_std must not be negative"),
    ("--train.lr=inf", "train.lr must be a finite number"),
    ("--train.min_lr=nan", "train.min_lr must be a finite number"),
    ("--train.grad_clip=inf", "train.grad_clip must be a finite number"),
    ("--data.path=", "data.path is empty"),
    ("--model.rope_theta=inf", "model.rope_theta must be a positive number"),
    ("--model.norm_eps=0", "model.norm_eps must be a positive number"),
    ("--parallel.bucket_mb=inf", "parallel.bucket_mb must be a positive number"),
    ("--parallel.receives_ahead=-1", "parallel.receives_ahead must be 0 or more, got -1"),
    ("--train.peak_flops=nan", "train.peak_flops must be a positive number of FLOP/s"),
    ("--train.peak_flops=0", "train.peak_flops must be a positive number of FLOP/s"),
    ("--model.num_layers=1000000000", "model.num_layers=1000000000 is beyond any model"),
    ("--model.hidden_size=1" + "0" * 30, "is beyond any model this runs"),
    ("--train.global_batch=1000000000", "train.global_batch=1000000000 is beyond any model"),
    ("--model.max_seq_len=1000000000000", "model.max_seq_len=1000000000000 is beyond"),
]


@pytest.mark.parametrize(("override", "message"), CONFIG_VALUES)
def test_config_values_that_crashed_later_are_refused(override, message):
    with pytest.raises(MeshtronError, match=message.replace("[", r"\[").replace(")", r"\)")):
        load_config(overrides=[override])


@pytest.mark.parametrize(("text", "message"), [
    ("train:\n  steps: 3\n  steps: 4\n", "line 3: key 'steps' given twice"),
    ("train:\n  steps: 3\nmodel:\n  preset: tiny\ntrain:\n  lr: 0.1\n",
     "line 5: key 'train' given twice"),
])
def test_a_key_given_twice_in_a_config_file_is_refused(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(MeshtronError, match=message):
        load_config(path)


def test_a_binary_config_file_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(MeshtronError, match="not a text file"):
        load_config(path)


@pytest.mark.parametrize(("args", "message"), [
    (["--max-new-tokens", "-5"], "--max-new-tokens must not be negative"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--top-k", "-3"], "--top-k must not be negative"),
    (["--top-p", "2"], "--top-p must lie in (0, 1]"),
    (["--top-p", "0"], "--top-p must lie in (0, 1]"),
])
def test_generate_refuses_meaningless_sampling_before_loading(tmp_path, capsys, args, message):
    missing = tmp_path / "no-such-run"  # the settings are refused before the path is looked at
    assert main(["generate", "--checkpoint", str(missing), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshtron: error: ") and message in err[0]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshtron: error: "), err
    return err[0]


def test_schedule_sizes_are_bounded(capsys):
    assert main(["schedule", "--pp", "100000", "--microbatches", "100000"]) == 2
    assert "--pp 100000 is beyond what `meshtron schedule` simulates" in one_error_line(capsys)
    assert main(["schedule", "--pp", "64", "--microbatches", "2048"]) == 2
    assert "at most 65536" in one_error_line(capsys)


def test_png_outputs_named_by_a_directory_go_inside_it(tmp_path, capsys):
    out_dir = tmp_path / "pngs"
    out_dir.mkdir()
    assert main(["schedule", "--pp", "2", "--microbatches", "2", "--out", str(out_dir)]) == 0
    written = out_dir / "schedule-1f1b-pp2-vpp1-m2.png"
    assert written.is_file() and f"timeline: {written}" in capsys.readouterr().out
    assert main(["schedule", "--pp", "2", "--microbatches", "2",
                 "--out", str(tmp_path / "plain")]) == 0
    assert (tmp_path / "plain.png").is_file() and "plain.png" in capsys.readouterr().out

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    assert main(["plot", str(run), "--output", str(out_dir)]) == 0
    assert (out_dir / "loss.png").is_file() and str(out_dir / "loss.png") in capsys.readouterr().out


def test_plot_of_a_binary_metrics_file_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(bytes(range(128, 256)) * 8)
    assert main(["plot", str(run)]) == 2
    assert "is not a metrics file (not UTF-8 text)" in one_error_line(capsys)



NOBODY = 65534
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _root_without_override() -> Callable[[], None]:
    """Root keeps its uid but the child loses the capabilities that skip permission checks
    (the bounding set is what root gets at exec), for when nobody cannot reach the Python."""
    libc = ctypes.CDLL(None, use_errno=True)  # looked up before the fork

    def drop() -> None:
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    return drop


Runner = Callable[..., subprocess.CompletedProcess]
PROBE = """import sys, meshtron
try:
    open(sys.argv[1], "w")
except PermissionError:
    sys.exit(13)
"""
"""Exits 13 where meshtron runs and the file cannot be written: the test can go ahead."""


@pytest.fixture
def read_only_dir() -> Iterator[tuple[Path, Runner]]:
    """A 0o555 directory and a runner of ``python ARGS`` that cannot write into it. Root ignores
    permission bits, so under root the child runs as nobody (in a scratch folder made
    traversable, unlike tmp_path's parents) or, where nobody cannot run this Python, as root
    without CAP_DAC_OVERRIDE; skipped where neither leaves the directory read-only."""
    base = Path(tempfile.mkdtemp(prefix="meshtron-ro-"))
    base.chmod(0o755)
    read_only = base / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["HOME"] = str(base)
    ways = [_as_nobody, _root_without_override()] if os.geteuid() == 0 else [None]

    def runner(preexec: Callable[[], None] | None) -> Runner:
        def run(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, *args], cwd=base, env=env, text=True,
                                  capture_output=True, timeout=120, preexec_fn=preexec)
        return run

    try:
        tried = []
        for preexec in ways:
            run = runner(preexec)
            try:
                probe = run("-c", PROBE, str(read_only / "probe"))
            except (OSError, subprocess.SubprocessError) as err:  # the preexec failed
                tried.append(repr(err))
                continue
            if probe.returncode == 13:
                yield read_only, run
                return
            tried.append(probe.stderr.strip()[-200:] or "the probe was written")
        pytest.skip(f"no read-only directory can be made here: {tried}")
    finally:
        read_only.chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


def assert_one_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[0].startswith("meshtron: error: ") and fragment in lines[0], lines[0]


def test_convert_to_a_read_only_place_is_refused_up_front(read_only_dir):
    read_only, run = read_only_dir
    source = read_only.parent / "model"  # refused before the source is even looked at
    proc = run("-m", "meshtron", "convert", "--from", str(source), "--to", str(read_only / "out"))
    assert_one_error(proc, f"--to {read_only / 'out'}: the folder {read_only} is not writable "
                           "(permission denied)")
    assert not (read_only / "out").exists()
    proc = run("-m", "meshtron", "convert", "--from", str(source), "--to", str(read_only))
    assert_one_error(proc, f"--to {read_only} is not writable (permission denied)")


def test_plot_to_a_read_only_place_is_refused_up_front(read_only_dir):
    read_only, run = read_only_dir
    metrics = read_only.parent / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 1, "loss": 2.5}\n')
    proc = run("-m", "meshtron", "plot", str(metrics.parent),
               "--output", str(read_only / "curve.png"))
    assert_one_error(proc, f"--output {read_only / 'curve.png'}: the folder {read_only} is not "
                           "writable (permission denied)")


@pytest.mark.parametrize(("args", "message"), [
    (["--parallel.schedule=interleaved"], "parallel.schedule=interleaved needs parallel.vpp >= 2"),
    (["--parallel.pp_layers=1,1"], "parallel.pp_layers=[1, 1] is set but there is no pipeline"),
    (["--model.hidden_size=65536", "--model.num_heads=64", "--model.num_kv_heads=64",
      "--model.ffn_hidden_size=262144"], "need at least"),
])
def test_settings_that_would_be_ignored_or_cannot_fit_are_refused_up_front(tmp_path, capsys,
                                                                           args, message):
    assert main(["train", f"--run.dir={tmp_path / 'run'}", *args]) == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_argparse_errors_are_one_line(capsys):
    for argv in (["train", "--nproc", "abc"], ["generate", "--max-new-tokens", "abc"],
                 ["schedule", "--pp", "abc"], ["nosuchcommand"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        line = one_error_line(capsys)
        assert "--help" in line, line


def test_generate_seed_and_preprocess_output_are_checked(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path), "--seed", str(2**70)]) == 2
    assert "--seed must fit in 64 bits" in one_error_line(capsys)
    text = tmp_path / "a.txt"
    text.write_text("hello world\n")
    assert main(["preprocess", str(text), "--output", ""]) == 2
    assert "names no file prefix" in one_error_line(capsys)
    (tmp_path / "afile").write_text("x")
    assert main(["preprocess", str(text), "--output", str(tmp_path / "afile" / "p")]) == 2
    assert "afile is a file, not a directory" in one_error_line(capsys)


def test_a_run_dir_whose_config_is_not_a_mapping_is_refused(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("[1, 2]\n")
    assert main(["train", f"--run.dir={tmp_path / 'run'}"]) == 2
    assert "config.yaml is not a run's config (a YAML mapping)" in one_error_line(capsys)


@pytest.mark.parametrize(("override", "message"), [
    ("--model.moe.route_scale=nan", "model.moe.route_scale must be a positive number"),
    ("--model.moe.aux_loss=inf", "model.moe.aux_loss must be a finite number"),
])
def test_moe_numbers_must_be_finite(override, message):
    with pytest.raises(MeshtronError, match=message):
        load_config(overrides=["--model.preset=tiny-moe", override])
