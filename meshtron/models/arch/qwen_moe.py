"""Qwen3-MoE: Qwen3 attention (per-head q/k norms) with softmax top-k routed SwiGLU experts,
optionally renormalised (``norm_topk_prob``), no shared experts; Hugging Face
``Qwen3MoeForCausalLM``. A variant of the Mixtral-style entry: a mixture of experts with
``model.qk_norm`` exports as Qwen3-MoE.

Which layers have experts: Qwen3-MoE says ``decoder_sparse_step`` and ``mlp_only_layers``,
meshtron ``model.moe.dense_layers`` then every ``model.moe.every``-th layer. An import finds
the meshtron pair that puts experts on the same layers and refuses a pattern none gives; an
export lists the dense layers in ``mlp_only_layers``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshtron.config import ModelConfig, MoEConfig
from meshtron.models.arch.llama import (
    ATTENTION_RULES,
    FIELDS,
    GLOBAL_RULES,
    MLP_RULES,
    block_fields,
)
from meshtron.models.arch.mixtral import TRAINING_FIELDS
from meshtron.models.arch.qwen import (
    QWEN_DEFAULTS,
    qwen3_refusals,
    qwen_window_fields,
    read_qwen3_attention,
)
from meshtron.models.architecture import HFConfig, HFFormat, HFModelType, TensorRule

EXPERT_RULES = (
    TensorRule(("mlp.router.weight",), ("mlp.gate.weight",)),
    TensorRule(("mlp.router.expert_bias",), ()),
    TensorRule(("mlp.experts.{j}.gate_up.weight",), ("mlp.experts.{j}.gate_proj.weight",
                                                     "mlp.experts.{j}.up_proj.weight")),
    TensorRule(("mlp.experts.{j}.down.weight",), ("mlp.experts.{j}.down_proj.weight",)),
)
QWEN3_MOE_DEFAULTS = dict(
    QWEN_DEFAULTS, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    num_key_value_heads=4, attention_bias=False, decoder_sparse_step=1,
    moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128, norm_topk_prob=False,
    router_aux_loss_coef=0.001, mlp_only_layers=None)


def expert_layers(hf: HFConfig, layers: int) -> list[bool]:
    """Which layers of a Qwen3-MoE config have experts (as ``Qwen3MoeDecoderLayer`` decides)."""
    step = hf.get("decoder_sparse_step")
    dense = hf.get("mlp_only_layers") or []
    hf.require(isinstance(dense, list) and all(isinstance(i, int) for i in dense),
               f"mlp_only_layers must be a list of layer numbers, got {dense!r}")
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def meshtron_pattern(hf: HFConfig, layers: int, saved: dict[str, Any]) -> tuple[int, int]:
    """(dense_layers, every) putting experts on the same layers: the pair a meshtron export
    kept when it still does, else the smallest."""
    wanted = expert_layers(hf, layers)
    hf.require(any(wanted), "no layer has experts (decoder_sparse_step / mlp_only_layers)")

    def gives(dense: int, every: int) -> bool:
        return [i >= dense and (i - dense) % every == 0 for i in range(layers)] == wanted

    kept = (saved.get("dense_layers"), saved.get("every"))
    if all(isinstance(v, int) and v >= 0 for v in kept) and kept[1] > 0 and gives(*kept):
        return kept
    for dense in range(layers):
        for every in range(1, layers + 1):
            if gives(dense, every):
                return dense, every
    on = [i for i, moe in enumerate(wanted) if moe]
    hf.refuse(f"experts on layers {on} (decoder_sparse_step / mlp_only_layers) cannot be said "
              "as model.moe.dense_layers followed by every model.moe.every-th layer")
    raise AssertionError  # refuse raised


def read_qwen3_moe_config(hf: HFConfig, values: dict[str, Any]) -> None:
    read_qwen3_attention(hf, values, per_layer=False)
    experts = hf.raw.get("num_experts", hf.raw.get("num_local_experts",
                                                   hf.defaults["num_experts"]))
    hf.require(isinstance(experts, int) and not isinstance(experts, bool) and experts > 0,
               f"'num_experts' must be a positive integer, got {experts!r}")
    top_k = hf.get("num_experts_per_tok")
    hf.require(top_k <= experts, f"num_experts_per_tok={top_k} exceeds num_experts={experts}")
    saved = hf.saved()
    kept = saved.get("moe") if isinstance(saved.get("moe"), dict) else {}
    dense, every = meshtron_pattern(hf, values["num_layers"], kept)
    moe = MoEConfig(
        num_experts=experts, top_k=top_k, expert_ffn_size=hf.get("moe_intermediate_size"),
        shared_experts=0, dense_layers=dense, every=every, score="softmax",
        normalize_topk=bool(hf.get("norm_topk_prob")), route_scale=1.0, groups=1,
        topk_groups=1, aux_loss=hf.get("router_aux_loss_coef"), capacity_factor=0.0,
        pad_to_capacity=False)
    values["moe"] = dataclasses.replace(
        moe, **{k: kept[k] for k in TRAINING_FIELDS if k in kept})


def refusals(cfg: ModelConfig) -> str | None:
    """What HF Qwen3-MoE cannot compute: shared experts, sigmoid or group-limited routing, a
    route scale, a capacity; attention as Qwen3's."""
    moe = cfg.moe
    checks = (
        (moe.shared_experts == 0, f"model.moe.shared_experts={moe.shared_experts}"),
        (moe.score == "softmax", f"model.moe.score={moe.score}"),
        (moe.groups == 1, f"model.moe.groups={moe.groups}"),
        (moe.route_scale == 1.0, f"model.moe.route_scale={moe.route_scale}"),
        (moe.capacity_factor == 0, f"model.moe.capacity_factor={moe.capacity_factor}"),
    )
    refused = [reason for ok, reason in checks if not ok]
    if refused:
        return f"this model has no Hugging Face Qwen3-MoE equivalent: {', '.join(refused)}"
    return qwen3_refusals(cfg, "Qwen3-MoE")


def qwen3_moe_config(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    return dict(
        attention_bias=cfg.qkv_bias, moe_intermediate_size=moe.expert_ffn_size,
        num_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
        norm_topk_prob=bool(moe.normalize_topk), router_aux_loss_coef=moe.aux_loss,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)],
        **block_fields(cfg), **qwen_window_fields(cfg))


QWEN3_MOE_FORMAT = HFFormat(
    model_types=(HFModelType("qwen3_moe", "Qwen3-MoE", "Qwen3MoeForCausalLM",
                             QWEN3_MOE_DEFAULTS),),
    fields=FIELDS, to_config=qwen3_moe_config, from_config=read_qwen3_moe_config,
    layer_prefix="model.layers.{i}.", layer_rules=ATTENTION_RULES + MLP_RULES + EXPERT_RULES,
    global_rules=GLOBAL_RULES, head="lm_head.weight", base_prefix="model.",
    refusals=refusals, accepts=lambda cfg: cfg.qk_norm,
    saved=lambda cfg: {"moe": {key: getattr(cfg.moe, key)
                               for key in (*TRAINING_FIELDS, "dense_layers", "every")}},
)
