"""Mixtral-style mixture of experts: llama blocks whose every MLP is a softmax top-k router
over SwiGLU experts, renormalised (a lone expert's weight is 1) and dropless; Hugging Face
``MixtralForCausalLM``, with its sliding window. Qwen3-MoE is this architecture's variant
(:mod:`meshtron.models.arch.qwen`).

A llama model with ``model.moe.num_experts`` set is this entry. Its routing extensions that
Mixtral cannot compute (shared experts, sigmoid or group-limited routing, dense layers, a
capacity, a selection bias) still train; they are refused only on export.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtron.config import ModelConfig, MoEConfig
from meshtron.models.arch.llama import (
    ATTENTION_RULES,
    FIELDS,
    GLOBAL_RULES,
    LLAMA,
    block_fields,
    read_blocks,
    read_window,
    refuse_biases,
)
from meshtron.models.architecture import HFConfig, HFFormat, HFModelType, TensorRule

EXPERT_RULES = (
    TensorRule(("mlp.router.weight",), ("block_sparse_moe.gate.weight",)),
    TensorRule(("mlp.router.expert_bias",), ()),
    TensorRule(("mlp.experts.{j}.gate_up.weight",), ("block_sparse_moe.experts.{j}.w1.weight",
                                                     "block_sparse_moe.experts.{j}.w3.weight")),
    TensorRule(("mlp.experts.{j}.down.weight",), ("block_sparse_moe.experts.{j}.w2.weight",)),
)
MIXTRAL_DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
    max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, tie_word_embeddings=False,
    sliding_window=None, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2,
    router_aux_loss_coef=0.001, router_jitter_noise=0.0)
TRAINING_FIELDS = ("aux_loss_scope", "z_loss", "bias_update", "compute")
"""``model.moe`` settings that only shape training, which HF Mixtral has no field for: an export
keeps them under ``meshtron`` in config.json so that importing it back restores them."""


def refusals(cfg: ModelConfig) -> str | None:
    """Every setting HF Mixtral cannot compute (llama blocks without biases or q/k norms,
    every MLP routed, softmax top-k renormalised, dropless), in one line."""
    moe = cfg.moe
    checks = (
        (moe.shared_experts == 0, f"model.moe.shared_experts={moe.shared_experts}"),
        (moe.score == "softmax", f"model.moe.score={moe.score}"),
        (moe.groups == 1, f"model.moe.groups={moe.groups}"),
        (moe.dense_layers == 0, f"model.moe.dense_layers={moe.dense_layers}"),
        (moe.every == 1, f"model.moe.every={moe.every}"),
        (moe.normalize_topk, "model.moe.normalize_topk=false"),
        (moe.route_scale == 1.0, f"model.moe.route_scale={moe.route_scale}"),
        (moe.capacity_factor == 0, f"model.moe.capacity_factor={moe.capacity_factor}"),
        *((not getattr(cfg, name), f"model.{name}=true")
          for name in ("qkv_bias", "proj_bias", "qk_norm")),
    )
    refused = [reason for ok, reason in checks if not ok]
    return (f"this mixture-of-experts model has no Hugging Face Mixtral equivalent: "
            f"{', '.join(refused)}") if refused else None


def read_mixtral_config(hf: HFConfig, values: dict[str, Any]) -> None:
    read_blocks(hf, values)
    refuse_biases(hf, "Mixtral")
    read_window(hf, values)
    top_k, experts = hf.get("num_experts_per_tok"), hf.get("num_local_experts")
    hf.require(top_k <= experts, f"num_experts_per_tok={top_k} exceeds num_local_experts="
               f"{experts}")
    moe = MoEConfig(
        num_experts=experts, top_k=top_k, expert_ffn_size=values["ffn_hidden_size"],
        shared_experts=0, dense_layers=0, every=1, score="softmax", normalize_topk=True,
        route_scale=1.0, groups=1, topk_groups=1, aux_loss=hf.get("router_aux_loss_coef"),
        capacity_factor=0.0, pad_to_capacity=False)
    saved = hf.saved()  # what a meshtron export kept; validated with the rest of the config
    if "ffn_hidden_size" in saved:  # unused when every layer has experts
        values["ffn_hidden_size"] = saved["ffn_hidden_size"]
    kept = saved.get("moe")
    if isinstance(kept, dict):
        moe = dataclasses.replace(moe, **{k: kept[k] for k in TRAINING_FIELDS if k in kept})
    values["moe"] = moe


def mixtral_config(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    return dict(intermediate_size=moe.expert_ffn_size, num_local_experts=moe.num_experts,
                num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss,
                router_jitter_noise=0.0, sliding_window=cfg.sliding_window, **block_fields(cfg))


MIXTRAL = dataclasses.replace(
    LLAMA, name="mixtral", experts=None, hf_variants=(),
    hf=HFFormat(
        model_types=(HFModelType("mixtral", "Mixtral", "MixtralForCausalLM", MIXTRAL_DEFAULTS),),
        fields=FIELDS, to_config=mixtral_config, from_config=read_mixtral_config,
        layer_prefix="model.layers.{i}.", layer_rules=ATTENTION_RULES + EXPERT_RULES,
        global_rules=GLOBAL_RULES, head="lm_head.weight", base_prefix="model.",
        refusals=refusals,
        saved=lambda cfg: {"ffn_hidden_size": cfg.ffn_hidden_size,
                           "moe": {key: getattr(cfg.moe, key) for key in TRAINING_FIELDS}},
    ),
    notes=("Mixtral 8x7B / 8x22B",),
)
