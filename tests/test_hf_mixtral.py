"""`meshtron convert` for Mixtral: meshtron MoE checkpoints to and from ``MixtralForCausalLM``.

The fast tests need no ``transformers``; as in test_hf_convert.py, the ones that build tiny
Mixtral models locally (nothing is downloaded) are marked slow: importing the modeling code of
``transformers`` alone takes seconds on CPU (over 15 s with a cold cache).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshtron.checkpoint.hf_convert import convert, hf_model_config
from meshtron.checkpoint.model_io import read_model_tensors, write_model_checkpoint
from meshtron.cli import main
from meshtron.models.transformer import Transformer
from tests.test_hf_convert import (
    cli_error,
    edit_config,
    max_diff,
    meshtron_checkpoint,
    write_tokenizer,
)

MOE = ("--model.moe.num_experts=4", "--model.moe.top_k=2", "--model.moe.expert_ffn_size=32",
       "--model.num_kv_heads=2")
"""On top of test_hf_convert's SHAPE: 2 layers, hidden 64, 4 heads, vocab 300 (padded 384)."""


def hf_export(tmp_path: Path, *overrides: str) -> Path:
    """An HF Mixtral folder written by meshtron's exporter (for hand-made corruptions)."""
    _, _, ckpt = meshtron_checkpoint(tmp_path / "ckpt", *MOE, *overrides)
    convert(ckpt, tmp_path / "hf", "hf")
    return tmp_path / "hf"


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


# ----------------------------------------------------------------------------- fast


def test_mixtral_meshtron_to_hf_to_meshtron_is_identical(tmp_path):
    training_only = ("--model.moe.z_loss=0.001", "--model.moe.aux_loss_scope=sequence",
                     "--model.moe.aux_loss=0.02", "--model.moe.bias_update=0.001")
    cfg, _, ckpt = meshtron_checkpoint(tmp_path / "ckpt", *MOE, *training_only, tokenizer=True)
    assert main(["convert", "--from", str(tmp_path / "ckpt"), "--to", str(tmp_path / "hf"),
                 "--format", "hf"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert config["intermediate_size"] == 32  # the expert's width, not ffn_hidden_size (96)
    assert config["router_aux_loss_coef"] == 0.02

    hf = load_file(tmp_path / "hf" / "model.safetensors")
    _, state = read_model_tensors(ckpt)
    assert not any("expert_bias" in name or "mlp.gate_proj" in name for name in hf)
    for i in range(2):
        src, dst = f"layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        assert torch.equal(hf[dst + "gate.weight"], state[src + "router.weight"])
        for j in range(4):
            gate_up = state[f"{src}experts.{j}.gate_up.weight"]
            assert torch.equal(hf[f"{dst}experts.{j}.w1.weight"], gate_up[:32])
            assert torch.equal(hf[f"{dst}experts.{j}.w3.weight"], gate_up[32:])
            assert torch.equal(hf[f"{dst}experts.{j}.w2.weight"],
                               state[f"{src}experts.{j}.down.weight"])

    assert main(["convert", "--from", str(tmp_path / "hf"), "--to", str(tmp_path / "back")]) == 0
    back_cfg, back = read_model_tensors(next((tmp_path / "back").glob("step_*")))
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert back_cfg.model == cfg.model  # training-only MoE settings come back via `meshtron`


def test_mixtral_config_defaults_are_the_transformers_class_defaults():
    cfg = hf_model_config({"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4,
                           "num_hidden_layers": 2, "vocab_size": 512})
    assert (cfg.arch, cfg.num_kv_heads, cfg.rope_theta, cfg.norm_eps) == ("llama", 8, 1e6, 1e-5)
    assert (cfg.ffn_hidden_size, cfg.moe.expert_ffn_size) == (14336, 14336)
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.aux_loss, moe.score) == (8, 2, 0.001, "softmax")
    assert (moe.normalize_topk, moe.route_scale, moe.shared_experts, moe.dense_layers,
            moe.every, moe.groups, moe.capacity_factor) == (True, 1.0, 0, 0, 1, 1, 0.0)
    assert all(cfg.is_moe_layer(i) for i in range(2))


UNSUPPORTED = {
    "shared experts": (("--model.moe.shared_experts=1",), "model.moe.shared_experts=1"),
    "sigmoid": (("--model.moe.score=sigmoid",), "model.moe.score=sigmoid"),
    "groups": (("--model.moe.groups=2",), "model.moe.groups=2"),
    "dense layers": (("--model.moe.dense_layers=1",), "model.moe.dense_layers=1"),
    "every": (("--model.moe.every=2",), "model.moe.every=2"),
    "unnormalised": (("--model.moe.normalize_topk=false",), "model.moe.normalize_topk=false"),
    "route scale": (("--model.moe.route_scale=2.5",), "model.moe.route_scale=2.5"),
    "capacity": (("--model.moe.capacity_factor=1.25",), "model.moe.capacity_factor=1.25"),
    "gpt2": (("--model.arch=gpt2",), "model.arch=gpt2"),
    "several": (("--model.moe.score=sigmoid", "--model.moe.route_scale=2.5"),
                "model.moe.score=sigmoid, model.moe.route_scale=2.5"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_moe_export_is_one_clear_line(tmp_path, capsys, case):
    overrides, fragment = UNSUPPORTED[case]
    meshtron_checkpoint(tmp_path / "ckpt", *MOE, *overrides)
    line = cli_error(capsys, "convert", "--from", tmp_path / "ckpt", "--to", tmp_path / "hf",
                     "--format", "hf")
    assert "has no Hugging Face Mixtral equivalent: " + fragment in line
    assert not (tmp_path / "hf").exists()


def test_nonzero_selection_bias_is_refused(tmp_path, capsys):
    cfg, model, _ = meshtron_checkpoint(tmp_path / "first", *MOE, "--model.moe.bias_update=0.001")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["layers.1.mlp.router.expert_bias"][2] = 0.001  # as training's balancing moves it
    write_model_checkpoint(tmp_path / "ckpt", cfg, state)
    line = cli_error(capsys, "convert", "--from", tmp_path / "ckpt", "--to", tmp_path / "hf",
                     "--format", "hf")
    assert "layers.1.mlp.router.expert_bias is not zero" in line
    assert not (tmp_path / "hf").exists()


def _missing_expert(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(folder / "model.safetensors"))


MIXTRAL_BREAKAGES = {
    "top-k > experts": (lambda f: edit_config(f, num_experts_per_tok=8),
                        "num_experts_per_tok=8 exceeds num_local_experts=4"),
    "attention bias": (lambda f: edit_config(f, attention_bias=True),
                       "attention_bias=true is not a Mixtral setting"),
    "more experts": (lambda f: edit_config(f, num_local_experts=5),
                     "has shape (4, 64), its config.json implies (5, 64)"),
    "missing expert": (_missing_expert,
                       "lacks tensor 'model.layers.1.block_sparse_moe.experts.3.w3.weight'"),
}


@pytest.mark.parametrize("case", list(MIXTRAL_BREAKAGES))
def test_bad_mixtral_folder_is_one_clear_line(tmp_path, capsys, case):
    breakage, fragment = MIXTRAL_BREAKAGES[case]
    folder = hf_export(tmp_path)
    breakage(folder)
    assert fragment in cli_error(capsys, "convert", "--from", folder, "--to", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_router_jitter_is_dropped_with_a_note(tmp_path):
    folder = hf_export(tmp_path)
    edit_config(folder, router_jitter_noise=0.1)
    notes = convert(folder, tmp_path / "out").notes
    assert any("router_jitter_noise=0.1 was dropped" in note for note in notes)


# ----------------------------------------------------------------------------- transformers


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def meshtron_logits(checkpoint: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of a single-process meshtron model loaded from ``checkpoint``, in eval mode."""
    cfg, state = read_model_tensors(checkpoint)
    model = Transformer(cfg.model)
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(tokens)[..., :cfg.model.vocab_size]


@pytest.mark.slow
def test_hf_mixtral_import_matches_transformers_and_round_trips(tmp_path, transformers):
    torch.manual_seed(5)
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, router_aux_loss_coef=0.02)
    hf = transformers.MixtralForCausalLM(config).eval()
    src = tmp_path / "src"
    hf.save_pretrained(src, safe_serialization=True, max_shard_size="100KB")  # index + shards
    write_tokenizer(src / "tokenizer.json")
    assert (src / "model.safetensors.index.json").is_file()

    assert main(["convert", "--from", str(src), "--to", str(tmp_path / "ckpt")]) == 0
    checkpoint = next((tmp_path / "ckpt").glob("step_*"))
    cfg, state = read_model_tensors(checkpoint)
    assert cfg.model.moe.aux_loss == 0.02 and cfg.model.rope_theta == 1e6
    assert not state["layers.0.mlp.router.expert_bias"].any()
    tokens = torch.randint(0, 256, (2, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    assert max_diff(meshtron_logits(checkpoint, tokens), expected) <= 1e-5

    assert main(["convert", "--from", str(tmp_path / "ckpt"), "--to", str(tmp_path / "back"),
                 "--format", "hf"]) == 0
    original, back = hf_tensors(src), hf_tensors(tmp_path / "back")
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], original[k]) for k in original)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again).__name__ == "MixtralForCausalLM"
    with torch.no_grad():
        assert max_diff(again(tokens).logits, expected) == 0.0


@pytest.mark.slow
def test_exported_mixtral_matches_in_transformers(tmp_path, transformers):
    cfg, _, ckpt = meshtron_checkpoint(tmp_path / "ckpt", *MOE, "--model.rope_theta=500000",
                                       tokenizer=True)
    assert main(["convert", "--from", str(ckpt), "--to", str(tmp_path / "hf"),
                 "--format", "hf"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 37),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits[..., :cfg.model.vocab_size]
    assert max_diff(meshtron_logits(ckpt, tokens), theirs) <= 1e-5
