"""`meshtron convert` for Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head
latent attention with yarn's softmax mscale, dense layers then sigmoid group-limited experts
with shared experts and the selection bias (``e_score_correction_bias``).

Models are built locally from a tiny config and every weight is randomised (the selection bias
too, so routing depends on it). Import: logits within 1e-5 of transformers; export back: tensors
bit-identical, transformers reloads the same logits; a meshtron model exports the other way.
Multi-token-prediction layers import, export back bit for bit, and a broken one is named.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshtron.checkpoint.hf_convert import convert, hf_model_config
from meshtron.checkpoint.hf_mapping import hf_format
from meshtron.checkpoint.model_io import read_model_tensors, write_model_checkpoint
from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer
from tests.test_hf_families import (
    assert_round_trip,
    meshtron_model,
    randomize,
    tokens,
)

TOLERANCE = 1e-5
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16, q_lora_rank=24,
             qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4, topk_group=2,
             num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=128)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 0.707, "original_max_position_embeddings": 32}
CASES = {
    "moe-yarn": dict(rope_parameters=YARN),
    "dense-uncompressed-queries": dict(q_lora_rank=None, first_k_dense_replace=3,
                                       tie_word_embeddings=True),
    "top1-unnormalised": dict(num_experts_per_tok=1, norm_topk_prob=False, n_group=2,
                              topk_group=1, routed_scaling_factor=1.0),
}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def hf_model(transformers, **extra):
    config = transformers.DeepseekV3Config(**{**SHAPE, **extra})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize(model, skip="no parameter is skipped")
    with torch.no_grad():  # the selection bias is a buffer: randomised too
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape,
                                               generator=torch.Generator().manual_seed(9)))
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_v3_imports_with_parity_and_round_trips(tmp_path, transformers, case):
    hf = hf_model(transformers, **CASES[case])
    hf.save_pretrained(tmp_path / "src")
    checkpoint = convert(tmp_path / "src", tmp_path / "ckpt").output
    cfg = read_model_tensors(checkpoint)[0].model
    assert cfg.latent_attention and cfg.is_moe == (case != "dense-uncompressed-queries")
    x = tokens(256)
    with torch.no_grad():
        theirs = hf(x).logits
        diff = float((meshtron_model(checkpoint)(x) - theirs).abs().max())
    assert diff <= TOLERANCE, diff

    assert_round_trip(transformers, tmp_path, hf, x, theirs)


@pytest.mark.parametrize("preset", ["tiny-deepseek", "tiny-mla"])
def test_meshtron_model_exports_as_deepseek_v3(tmp_path, transformers, preset):
    cfg = load_config(overrides=[f"--model.preset={preset}", "--model.vocab_size=300",
                                 "--model.num_layers=2", "--model.max_seq_len=128",
                                 "--model.hidden_size=64", "--model.ffn_hidden_size=96",
                                 *(("--model.moe.expert_ffn_size=32",) if "deepseek" in preset
                                   else ()),
                                 "--train.seq_len=64", "--model.rope.scaling=yarn",
                                 "--model.rope.factor=4", "--model.rope.original_max_len=32",
                                 "--model.rope.mscale_all_dim=1"])
    model = Transformer(cfg.model)
    initialize(model, seed=7, std=0.02, num_layers=2)
    randomize(model, skip="no parameter is skipped")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    write_model_checkpoint(tmp_path / "ckpt", cfg, state)
    convert(tmp_path / "ckpt", tmp_path / "hf", "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["num_nextn_predict_layers"] == cfg.model.mtp_depth == ("deepseek" in preset)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = tokens(300, 37)
    with torch.no_grad():
        assert float((model.eval()(x) - hf(x).logits).abs().max()) <= TOLERANCE

    back = convert(tmp_path / "hf", tmp_path / "back").output
    back_cfg, back_state = read_model_tensors(back)
    assert back_cfg.model == dataclasses.replace(cfg.model, preset="tiny")  # all explicit
    assert all(torch.equal(back_state[k], state[k]) for k in state)


def test_multi_token_prediction_layers_import_and_round_trip(tmp_path, transformers):
    """The release keeps its MTP module as ``model.layers.{num_hidden_layers}`` (a decoder layer
    with its norms, merge projection and copies of the embedding and head); transformers'
    model has none and ignores it. meshtron imports it as its module, exports it back bit for
    bit, and names a partial or inconsistent one."""
    hf = hf_model(transformers)
    hf.save_pretrained(tmp_path / "plain")
    converted = convert(tmp_path / "plain", tmp_path / "plain-ckpt")
    assert any("holds none (as transformers saves them)" in note for note in converted.notes)
    assert read_model_tensors(converted.output)[0].model.mtp_depth == 0

    weights = load_file(tmp_path / "plain" / "model.safetensors")
    gen = torch.Generator().manual_seed(4)
    mtp = {name.replace("layers.2.", "layers.3."): value.clone()
           for name, value in weights.items() if name.startswith("model.layers.2.")}
    mtp.update({f"model.layers.3.{name}": torch.rand(64, generator=gen) + 0.5
                for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(64, 128, generator=gen) * 0.05
    mtp["model.layers.3.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    mtp["model.layers.3.shared_head.head.weight"] = weights["lm_head.weight"].clone()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text((tmp_path / "plain" / "config.json").read_text())
    save_file({**weights, **mtp}, tmp_path / "src" / "model.safetensors",
              metadata={"format": "pt"})
    checkpoint = convert(tmp_path / "src", tmp_path / "ckpt").output
    cfg, state = read_model_tensors(checkpoint)
    assert cfg.model.mtp_depth == 1
    assert torch.equal(state["layers.3.merge.weight"], mtp["model.layers.3.eh_proj.weight"])
    assert torch.equal(state["layers.3.attn.kv_b.weight"],
                       mtp["model.layers.3.self_attn.kv_b_proj.weight"])
    x = tokens(256)
    with torch.no_grad():
        theirs = hf(x).logits
        assert float((meshtron_model(checkpoint)(x) - theirs).abs().max()) <= TOLERANCE
    assert_round_trip(transformers, tmp_path, hf, x, theirs)

    broken = {"partial": ({**weights, "model.layers.3.eh_proj.weight": torch.zeros(64, 128)},
                          "lacks tensor 'model.layers.3."),
              "copy": ({**weights, **mtp, "model.layers.3.embed_tokens.weight":
                        torch.zeros(256, 64)}, "differs from the model's embedding"),
              "beyond": ({**weights, **mtp, "model.layers.4.eh_proj.weight":
                          torch.zeros(64, 128)}, "holds layer model.layers.4, beyond the 3 "
                                                 "decoder and 1 multi-token-prediction layers")}
    for case, (tensors, fragment) in broken.items():
        save_file(tensors, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(MeshtronError) as err:
            convert(tmp_path / "src", tmp_path / f"ckpt-{case}")
        assert fragment in str(err.value) and "\n" not in str(err.value), case


def test_deepseek_refusals_are_one_line_each():
    base = dict(SHAPE, model_type="deepseek_v3")
    refused = {
        "rope layout": (dict(base, rope_interleave=False), "rope_interleave=false"),
        "biases": (dict(base, attention_bias=True), "attention_bias=true is not supported"),
        "kv heads": (dict(base, num_key_value_heads=2), "num_key_value_heads=2 differs"),
        "no shared": (dict(base, n_shared_experts=0), "n_shared_experts=0 is not supported"),
        "activation": (dict(base, hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    }
    for name, (config, fragment) in refused.items():
        with pytest.raises(MeshtronError) as err:
            hf_model_config(config)
        assert fragment in str(err.value) and "\n" not in str(err.value), name
    cfg = load_config(overrides=["--model.preset=tiny-deepseek", "--model.vocab_size=300",
                                 "--model.moe.score=softmax", "--model.moe.every=2"]).model
    with pytest.raises(MeshtronError, match="no Hugging Face DeepSeek-V3 equivalent: "
                                            "model.moe.score=softmax, model.moe.every=2"):
        hf_format(cfg)
