"""Inputs found by an adversarial pass that used to pass validation and crash later (or be
silently ignored): each now ends in one `meshtron: error:` line before anything runs."""

from __future__ import annotations

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
