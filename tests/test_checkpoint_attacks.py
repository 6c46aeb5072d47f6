"""Crafted newest checkpoints, each through resume, ``generate`` and ``convert``.

A complete checkpoint that is damaged, edited or hostile must stop each command with one
``meshtron: error:`` line naming it (never a fallback to the previous checkpoint, a run from
scratch or a traceback). Every attack is crafted here from a real two-checkpoint run; no
stored fixtures, no pickles.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshtron.cli import main
from meshtron.config import load_config
from meshtron.training.trainer import train
from tests.parity import test_overrides

NEWEST = "step_00000002"


@pytest.fixture(scope="module")
def trained(data_cache, tmp_path_factory) -> tuple[Path, list[str]]:
    """A run with checkpoints at steps 1 and 2, and the overrides that trained it."""
    run = tmp_path_factory.mktemp("attacked") / "run"
    overrides = test_overrides(data_cache, str(run), 2) + ["--checkpoint.every=1"]
    train(load_config(overrides=overrides), log=lambda m: None)
    return run, overrides


def _manifest(ckpt: Path, edit: Callable[[dict], object]) -> None:
    manifest = json.loads((ckpt / "meta.json").read_text())
    edit(manifest)
    (ckpt / "meta.json").write_text(json.dumps(manifest))


def _rewrite_shard(ckpt: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Change the shard's tensors and record the new checksum, as a careful attacker would."""
    shard = ckpt / "shard-00000.safetensors"
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    _manifest(ckpt, lambda m: m["files"].update({shard.name: digest}))


def _first_weight(ckpt: Path) -> tuple[str, str]:
    manifest = json.loads((ckpt / "meta.json").read_text())
    name = next(n for n in manifest["tensors"] if n.startswith("model/"))
    return name, manifest["tensors"][name]["pieces"][0]["key"]


def _nan_weights(ckpt: Path) -> None:
    _, key = _first_weight(ckpt)
    _rewrite_shard(ckpt, lambda t: t[key].fill_(float("nan")))


def _flip_byte(ckpt: Path) -> None:
    shard = ckpt / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))


def _huge_shape(ckpt: Path) -> None:
    name, _ = _first_weight(ckpt)

    def grow(m: dict) -> None:
        m["tensors"][name]["shape"] = [10**12, 10**6]
        m["tensors"][name]["pieces"][0]["size"] = [10**12, 10**6]
    _manifest(ckpt, grow)


def _drop_weight(ckpt: Path) -> None:
    name, _ = _first_weight(ckpt)
    _manifest(ckpt, lambda m: m["tensors"].pop(name))


def _hidden(size: int) -> Callable[[dict], object]:
    return lambda m: m["config"]["model"].update(hidden_size=size)


ATTACKS: dict[str, tuple[Callable[[Path], object], str]] = {
    "manifest deleted": (lambda c: (c / "meta.json").unlink(), "meta.json is missing"),
    "manifest garbage": (lambda c: (c / "meta.json").write_bytes(b"\x00\xff" * 64),
                         "is not valid JSON"),
    "manifest a JSON list": (lambda c: (c / "meta.json").write_text("[1, 2]"), "unknown format"),
    "manifest nested deeply": (lambda c: (c / "meta.json").write_text("[" * 100_000),
                               "is not valid JSON"),
    "unknown format": (lambda c: _manifest(c, lambda m: m.update(format=99)), "unknown format"),
    "absolute file name": (lambda c: _manifest(c, lambda m: m["files"].update(
        {"/etc/passwd": "0" * 64})), "names a file outside itself"),
    "file name with ..": (lambda c: _manifest(c, lambda m: m["files"].update(
        {"../x": "0" * 64})), "names a file outside itself"),
    "a pickled .bin listed": (lambda c: _manifest(c, lambda m: m["files"].update(
        {"model.bin": "0" * 64})), "never pickled"),
    "checksum not a sha256": (lambda c: _manifest(c, lambda m: m["files"].update(
        {"shard-00000.safetensors": "abc"})), "neither an xxh3-128 nor a sha256"),
    "shape of 10**18 elements": (_huge_shape, "the index places"),
    "shape of floats": (lambda c: _manifest(c, lambda m: next(iter(m["tensors"].values())).update(
        shape=[1e12, 1e6])), "must be a list of non-negative integers"),
    "dtype not allowed": (lambda c: _manifest(c, lambda m: next(iter(m["tensors"].values())).update(
        dtype="object")), "no valid dtype"),
    "config missing": (lambda c: _manifest(c, lambda m: m.pop("config")), "holds no config"),
    "hidden size 2**24": (lambda c: _manifest(c, _hidden(2**24)),
                          "holds an invalid config: model.hidden_size=16777216 is beyond any"),
    "hidden size of another model": (lambda c: _manifest(c, _hidden(128)),
                                     "its config implies [512, 128]"),
    "a million layers": (lambda c: _manifest(c, lambda m: m["config"]["model"].update(
        num_layers=10**6)), "model.num_layers=1000000 is beyond any model"),
    "layers of another model": (lambda c: _manifest(c, lambda m: m["config"]["model"].update(
        num_layers=50_000)), "holds 2 layers, its config says model.num_layers=50000"),
    "unknown preset": (lambda c: _manifest(c, lambda m: m["config"]["model"].update(
        preset="gigantic")), "unknown model.preset 'gigantic'"),
    "RNG key names no tensor": (lambda c: _manifest(c, lambda m: m["rng"]["0"].update(
        key="nope")), "(an RNG state) is missing"),
    "RNG key names a weight": (lambda c: _manifest(c, lambda m: m["rng"]["0"].update(
        key="p0")), "is not an RNG state"),
    "step -5": (lambda c: _manifest(c, lambda m: m.update(step=-5)), "step must be a whole"),
    "step 'six'": (lambda c: _manifest(c, lambda m: m.update(step="six")), "step must be a whole"),
    "step 1e9": (lambda c: _manifest(c, lambda m: m.update(step=1e9)), "step must be a whole"),
    "step of another directory": (lambda c: _manifest(c, lambda m: m.update(step=10**9)),
                                  "says it is step 1000000000"),
    "RNG key into an unlisted file": (lambda c: _manifest(c, lambda m: m["rng"]["0"].update(
        file="shard-00009.safetensors")), "RNG states must name a listed shard"),
    "loss scale garbage": (lambda c: _manifest(c, lambda m: m.update(loss_scale=["x", 0])),
                           "loss_scale must be"),
    "shard byte flipped": (_flip_byte, "is corrupt (checksum mismatch)"),
    "shard truncated": (lambda c: (c / "shard-00000.safetensors").write_bytes(b"\x00" * 16),
                        "the index places"),
    "NaN weights, checksum matching": (_nan_weights, "holds NaN or infinite values"),
    "a weight dropped from the index": (_drop_weight, "lacks"),
    "a file named like a newer step": (lambda c: (c.parent / "step_00000003").write_text("x"),
                                       "is a file named like a checkpoint directory"),
}


RESUME_MESSAGES = {"config missing": "holds no config",
                   "hidden size of another model": "another model",
                   "layers of another model": "another model"}
NOT_READ_BY = {"generate and convert": ("RNG key names no tensor", "RNG key names a weight")}
"""What a command never reads cannot stop it: RNG states matter only to a resume."""


def _craft(trained: tuple[Path, list[str]], tmp_path: Path, attack: str) -> Path:
    run, _ = trained
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ATTACKS[attack][0](copy / "checkpoints" / NEWEST)
    return copy


def _refused(capsys, code: int, expected: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("meshtron: error: "), err
    assert expected in err[0], err[0]


@pytest.mark.parametrize("attack", [a for a in ATTACKS if a not in NOT_READ_BY[
    "generate and convert"]])
def test_a_crafted_newest_checkpoint_stops_generate_and_convert(trained, tmp_path, capsys, attack):
    copy = _craft(trained, tmp_path, attack)
    expected = ATTACKS[attack][1]
    code = main(["generate", "--checkpoint", str(copy), "--prompt", "hi", "--max-new-tokens", "2"])
    _refused(capsys, code, expected)
    code = main(["convert", "--from", str(copy / "checkpoints"), "--to", str(tmp_path / "hf"),
                 "--format", "hf"])
    _refused(capsys, code, expected)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("attack", [a for a in ATTACKS if a != "manifest nested deeply"])
def test_a_crafted_newest_checkpoint_stops_the_resume(trained, tmp_path, capsys, attack):
    copy = _craft(trained, tmp_path, attack)
    _, overrides = trained
    args = [o for o in overrides if not o.startswith(("--run.dir", "--train.steps",
                                                      "--checkpoint.resume"))]
    code = main(["train", *args, f"--run.dir={copy}", "--train.steps=3"])
    _refused(capsys, code, RESUME_MESSAGES.get(attack, ATTACKS[attack][1]))
    assert not (copy / "checkpoints" / "step_00000003").is_dir()


def test_a_replaced_tokenizer_is_refused_where_it_is_read(trained, tmp_path, capsys):
    copy = _craft(trained, tmp_path, "unknown format")
    shutil.rmtree(copy / "checkpoints" / NEWEST)
    ckpt = copy / "checkpoints" / "step_00000001"
    tokenizer = json.loads((ckpt / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = []
    (ckpt / "tokenizer.json").write_text(json.dumps(tokenizer))
    code = main(["generate", "--checkpoint", str(ckpt), "--prompt", "hi", "--max-new-tokens", "1"])
    _refused(capsys, code, "tokenizer.json is corrupt (checksum mismatch)")
    code = main(["convert", "--from", str(ckpt), "--to", str(tmp_path / "hf"), "--format", "hf"])
    _refused(capsys, code, "tokenizer.json is corrupt (checksum mismatch)")
    (ckpt / "tokenizer.json").unlink()
    code = main(["generate", "--checkpoint", str(ckpt), "--prompt", "hi", "--max-new-tokens", "1"])
    _refused(capsys, code, "tokenizer.json is missing")


def test_falling_back_is_opt_in_and_an_interrupted_save_is_skipped_on_stderr(trained, tmp_path,
                                                                              capsys):
    copy = _craft(trained, tmp_path, "shard byte flipped")
    _, overrides = trained
    args = [o for o in overrides if not o.startswith(("--run.dir", "--train.steps",
                                                      "--checkpoint.resume"))]
    args += [f"--run.dir={copy}", "--train.steps=3", "--checkpoint.on_corrupt=previous"]
    shutil.copytree(copy / "checkpoints" / "step_00000001",
                    copy / "checkpoints" / ".tmp-step_00000003-0123")
    assert main(["train", *args]) == 0
    captured = capsys.readouterr()
    warnings = captured.err.strip().splitlines()
    assert any("ignoring" in w and ".tmp-step_00000003-0123" in w for w in warnings), warnings
    assert any(f"skipping an unusable checkpoint: checkpoint file {copy}/checkpoints/{NEWEST}/"
               "shard-00000.safetensors is corrupt" in w for w in warnings), warnings
    assert "resumed from" in captured.out and "step_00000001 at step 1" in captured.out
