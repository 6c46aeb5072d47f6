"""Bad files found by the adversarial pass (issue 22): a run's metrics.jsonl that holds nothing
to plot, YAML configs nested too deeply, and Hugging Face folders that are nested too deeply,
hold NaN or infinite weights, or name a class of another family. Each ends in one
`meshtron: error:` line and exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshtron.cli import main
from tests.test_bad_input import one_error_line

# ----------------------------------------------------------------------------- plot

NOTHING_TO_PLOT = {
    "empty": "",
    "garbage": "oops\n{bad",
    "json lists": "[1,2]\n[3]\n",
    "no loss": '{"step":1}\n',
    "string loss": '{"step":1,"loss":"x"}\n',
    "no step": '{"loss":1.0}\n',
    "bool loss": '{"step":1,"loss":true}\n',
    "float step": '{"step":1.5,"loss":1.0}\n',
    "nan loss": '{"step":1,"loss":NaN}\n',
    "deep line": "[" * 100_000 + "\n",
    "only events": '{"event":"straggler","step":3,"rank":1}\n',
}


def run_dir(tmp_path: Path, text: str) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(text)
    return run


@pytest.mark.parametrize("case", list(NOTHING_TO_PLOT))
def test_plot_of_a_run_with_nothing_to_draw_is_refused(tmp_path, capsys, case):
    run = run_dir(tmp_path, NOTHING_TO_PLOT[case])
    assert main(["plot", str(run)]) == 2
    line = one_error_line(capsys)
    assert f"{run / 'metrics.jsonl'} holds no rows with an integer step and a finite loss" in line
    assert not (run / "loss.png").exists()


def test_plot_skips_events_and_bad_rows_and_draws_the_rest(tmp_path, capsys):
    from matplotlib.figure import Figure

    from meshtron.training.plot import draw_runs

    run = run_dir(tmp_path, '{"step":1,"loss":3.0}\n{"event":"straggler","step":2}\n'
                            '{"loss":9}\n{"step":2,"loss":"x"}\n{"step":3,"loss":2,"val_loss":2.5}\n'
                            '{"step":4,"val_loss":2.25}\n{"step":5,"lo')
    ax = Figure().add_subplot()
    draw_runs(ax, [run])
    train, valid = ax.get_lines()
    assert train.get_xydata().tolist() == [[1.0, 3.0], [3.0, 2.0]]
    assert valid.get_xydata().tolist() == [[3.0, 2.5], [4.0, 2.25]]
    assert main(["plot", str(run)]) == 0 and (run / "loss.png").is_file()
    assert capsys.readouterr().err == ""


def test_plot_of_several_runs_names_the_one_with_nothing_to_draw(tmp_path, capsys):
    good = tmp_path / "good"
    good.mkdir()
    (good / "metrics.jsonl").write_text('{"step":1,"loss":1.0}\n')
    bad = run_dir(tmp_path, '{"step":1}\n')
    assert main(["plot", str(good), str(bad), "--output", str(tmp_path / "both.png")]) == 2
    assert f"{bad / 'metrics.jsonl'} holds no rows" in one_error_line(capsys)


# ----------------------------------------------------------------------------- YAML config


def test_a_config_file_nested_too_deeply_is_refused(tmp_path, capsys):
    path = tmp_path / "deep.yaml"
    path.write_text("model: " + "[" * 20000 + "]" * 20000 + "\n")
    assert main(["train", "--config", str(path), "--run.dir", str(tmp_path / "run")]) == 2
    assert f"{path} is nested too deeply" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_an_override_nested_too_deeply_is_refused(tmp_path, capsys):
    value = "[" * 20000 + "]" * 20000
    assert main(["train", f"--model.preset={value}", "--run.dir", str(tmp_path / "run")]) == 2
    assert "override --model.preset is nested too deeply" in one_error_line(capsys)


# ----------------------------------------------------------------------------- HF folders


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny LlamaForCausalLM folder saved by transformers (built locally, nothing
    downloaded)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture
def hf(tiny_llama, tmp_path) -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(tiny_llama, folder)
    return folder


def convert_error(capsys, hf: Path) -> str:
    out = hf.parent / "out"
    assert main(["convert", "--from", str(hf), "--to", str(out)]) == 2
    assert not out.exists()
    return one_error_line(capsys)


def test_the_tiny_llama_folder_converts(hf, capsys):
    assert main(["convert", "--from", str(hf), "--to", str(hf.parent / "out")]) == 0
    assert capsys.readouterr().err == ""


def test_an_hf_config_nested_too_deeply_is_refused(hf, capsys):
    (hf / "config.json").write_text("[" * 100_000)
    assert f"{hf / 'config.json'} is nested too deeply" in convert_error(capsys, hf)


def test_an_hf_index_nested_too_deeply_is_refused(hf, capsys):
    (hf / "model.safetensors").rename(hf / "model-00001-of-00001.safetensors")
    (hf / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000)
    assert f"{hf / 'model.safetensors.index.json'} is nested too deeply" in convert_error(capsys,
                                                                                          hf)


@pytest.mark.parametrize(("name", "value"), [("model.embed_tokens.weight", float("nan")),
                                             ("model.norm.weight", float("inf")),
                                             ("model.layers.1.mlp.up_proj.weight", float("-inf"))])
def test_hf_weights_with_nan_or_inf_are_refused(hf, capsys, name, value):
    tensors = load_file(hf / "model.safetensors")
    tensors[name] = torch.full_like(tensors[name], value)
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    assert f"tensor '{name}' in {hf} holds NaN or infinite values" in convert_error(capsys, hf)


def edit_config(hf: Path, **changes) -> None:
    path = hf / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(("architectures", "named"), [
    (["BertModel"], "BertModel"),
    (["LlamaForCausalLM", "MistralForCausalLM"], "MistralForCausalLM"),
])
def test_hf_architectures_of_another_family_are_refused(hf, capsys, architectures, named):
    edit_config(hf, architectures=architectures)
    line = convert_error(capsys, hf)
    assert f"architectures names {named}, which is not a Llama class" in line


@pytest.mark.parametrize("architectures", ["LlamaForCausalLM", [1], {"a": 1}])
def test_hf_architectures_that_are_not_a_list_of_names_are_refused(hf, capsys, architectures):
    edit_config(hf, architectures=architectures)
    assert "'architectures' must be a list of class names" in convert_error(capsys, hf)


def test_hf_model_type_that_is_not_a_name_is_refused(hf, capsys):
    edit_config(hf, model_type=["llama"])
    assert "unsupported architecture" in convert_error(capsys, hf)
