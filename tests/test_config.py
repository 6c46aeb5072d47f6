"""Config parsing, presets and every validation error's one-line message."""

import pytest
import yaml

from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.plan import check_run


def test_defaults_resolve_from_the_preset():
    cfg = load_config()
    assert cfg.model.preset == "tiny"
    assert cfg.model.num_layers == 4 and cfg.model.num_kv_heads == 4
    assert cfg.model.vocab_size is None  # taken from the tokenizer at train time


def test_explicit_fields_win_over_the_preset():
    cfg = load_config(overrides=["--model.hidden_size=64", "--model.num_heads=4"])
    assert cfg.model.hidden_size == 64 and cfg.model.num_layers == 4


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"steps": 7, "lr": 0.01}, "parallel": {"sp": True}}))
    cfg = load_config(path, ["--train.steps=9", "--data.path=0.7:a.txt,0.3:b.txt"])
    assert cfg.train.steps == 9 and cfg.train.lr == 0.01 and cfg.parallel.sp is True
    assert cfg.data.path == ["0.7:a.txt", "0.3:b.txt"]


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(overrides=["--model.preset=small"])
    cfg.save(tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--model.hiden_size=3"], "unknown config key 'model.hiden_size' (did you mean "
                                   "'model.hidden_size'?)"),
        (["--trian.steps=3"], "unknown config section 'trian' (did you mean 'train'?)"),
        (["--train.steps=abc"], "train.steps: expected int, got 'abc'"),
        (["--parallel.pp_layers=2.5,x"], "parallel.pp_layers: expected int or float, got 'x'"),
        (["--train.global_batch=-4"], "train.global_batch must be a positive integer, got -4"),
        (["--train.micro_batch=3"], "train.global_batch=8 is not a multiple of "
                                    "train.micro_batch=3"),
        (["--train.seq_len=4096"], "train.seq_len=4096 exceeds the model's positions"),
        (["--model.preset=tinny"], "unknown model.preset 'tinny' (did you mean 'tiny'?)"),
        (["--precision.dtype=fp8"], "precision.dtype='fp8' is not one of fp32, bf16, fp16, fp64"),
        (["--model.num_heads=3"], "model.hidden_size=256 is not divisible by model.num_heads=3"),
        (["--parallel.zero=5"], "parallel.zero must be 0, 1, 2 or 3"),
        (["--parallel.cp_comm=ulysses"],
         "parallel.cp_comm='ulysses' is not one of ring, all_to_all, all_gather"),
        (["--precision.dtype=fp64", "--precision.fp8=tensorwise"],
         "precision.dtype=fp64 is for verification runs and does not combine with precision.fp8"),
        (["--precision.dtype=fp64", "--precision.reduce_dtype=bf16"],
         "leave precision.reduce_dtype at fp32"),
        (["--model.arch=gtp2"], "model.arch='gtp2' is not one of llama, gpt2, gemma3 (did you"),
        (["train.steps=3"], None),
        (["--train"], "must look like --section.field=value"),
    ],
)
def test_bad_config_gives_one_clear_line(overrides, message):
    if message is None:  # a bare `section.field=value` is accepted too
        assert load_config(overrides=overrides).train.steps == 3
        return
    with pytest.raises(MeshtronError) as err:  # a field's own checks, then the run plan's
        check_run(load_config(overrides=overrides), 1)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_yaml_errors(tmp_path):
    with pytest.raises(MeshtronError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(MeshtronError, match="not valid YAML"):
        load_config(bad)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("train:\n  stepz: 3\n")
    with pytest.raises(MeshtronError, match=r"unknown.yaml: unknown config key 'train.stepz'"):
        load_config(unknown)


def test_layout_checks_need_the_world_size():
    cfg = load_config(overrides=["--parallel.tp=3"])
    with pytest.raises(MeshtronError, match="world size 4 is not divisible"):
        check_run(cfg, 4)
    cfg = load_config(overrides=["--parallel.tp=3"])
    with pytest.raises(MeshtronError, match="parallel.tp=3 does not divide model.num_heads=8"):
        check_run(cfg, 3)
