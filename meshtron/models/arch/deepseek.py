"""DeepSeek-V3: llama blocks with multi-head latent attention
(:class:`~meshtron.models.latent.LatentAttention`) and, after ``first_k_dense_replace`` dense
layers, sigmoid group-limited routed experts with shared experts and the aux-loss-free
selection bias (``e_score_correction_bias``); Hugging Face ``DeepseekV3ForCausalLM``.

A llama model with ``model.attention=mla`` is this entry, with or without experts (a dense one
exports with every layer below ``first_k_dense_replace``). Multi-token-prediction layers
(``num_nextn_predict_layers``) follow the decoder's as ``model.layers.{num_hidden_layers + k}``,
a decoder layer with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the
embedding and head (``embed_tokens``, ``shared_head.head``); they import as meshtron's
``model.mtp_depth`` modules and export the same way. ``transformers`` has no such module: it
ignores those tensors, and a folder it saved has none, so a config that counts MTP layers
without them imports with ``mtp_depth`` 0 (said in a note).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from meshtron.config import ModelConfig, MoEConfig
from meshtron.models.arch.hf_rope import read_rope, rope_fields
from meshtron.models.arch.llama import GLOBAL_RULES, LLAMA, MLP_RULES
from meshtron.models.architecture import HFConfig, HFFormat, HFModelType, TensorRule
from meshtron.models.latent import LatentAttention

FIELDS = (
    ("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
    ("num_heads", "num_attention_heads"), ("ffn_hidden_size", "intermediate_size"),
    ("max_seq_len", "max_position_embeddings"), ("norm_eps", "rms_norm_eps"),
    ("rope_theta", "rope_theta"), ("tie_embeddings", "tie_word_embeddings"),
    ("kv_lora_rank", "kv_lora_rank"), ("qk_nope_head_dim", "qk_nope_head_dim"),
    ("qk_rope_head_dim", "qk_rope_head_dim"), ("v_head_dim", "v_head_dim"),
)
ATTENTION_RULES = (
    TensorRule(("attn.q.weight",), ("self_attn.q_proj.weight",)),
    TensorRule(("attn.q_a.weight",), ("self_attn.q_a_proj.weight",)),
    TensorRule(("attn.q_a_norm.weight",), ("self_attn.q_a_layernorm.weight",)),
    TensorRule(("attn.q_b.weight",), ("self_attn.q_b_proj.weight",)),
    TensorRule(("attn.kv_a.weight",), ("self_attn.kv_a_proj_with_mqa.weight",)),
    TensorRule(("attn.kv_a_norm.weight",), ("self_attn.kv_a_layernorm.weight",)),
    TensorRule(("attn.kv_b.weight",), ("self_attn.kv_b_proj.weight",)),
    TensorRule(("attn.proj.weight",), ("self_attn.o_proj.weight",)),
    TensorRule(("attn_norm.weight",), ("input_layernorm.weight",)),
    TensorRule(("mlp_norm.weight",), ("post_attention_layernorm.weight",)),
)
"""``attn.q`` (uncompressed queries) or ``attn.q_a`` / ``q_b``: a model has one or the other."""
EXPERT_RULES = (
    TensorRule(("mlp.router.weight",), ("mlp.gate.weight",)),
    TensorRule(("mlp.router.expert_bias",), ("mlp.gate.e_score_correction_bias",)),
    TensorRule(("mlp.experts.{j}.gate_up.weight",), ("mlp.experts.{j}.gate_proj.weight",
                                                     "mlp.experts.{j}.up_proj.weight")),
    TensorRule(("mlp.experts.{j}.down.weight",), ("mlp.experts.{j}.down_proj.weight",)),
    TensorRule(("mlp.shared.gate_up.weight",), ("mlp.shared_experts.gate_proj.weight",
                                                "mlp.shared_experts.up_proj.weight")),
    TensorRule(("mlp.shared.down.weight",), ("mlp.shared_experts.down_proj.weight",)),
)
MTP_RULES = (
    TensorRule(("embed_norm.weight",), ("enorm.weight",)),
    TensorRule(("hidden_norm.weight",), ("hnorm.weight",)),
    TensorRule(("merge.weight",), ("eh_proj.weight",)),
    TensorRule(("head_norm.weight",), ("shared_head.norm.weight",)),
)
"""A multi-token-prediction layer's own tensors beyond its decoder layer's."""
DEEPSEEK_DEFAULTS = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
    n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
    num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
    max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_theta=10000.0, rope_interleave=True, attention_bias=False, num_nextn_predict_layers=1)
TRAINING_FIELDS = ("aux_loss", "aux_loss_scope", "z_loss", "bias_update", "compute")
"""``model.moe`` settings that only shape training (HF DeepSeek-V3 has no field for them):
kept under ``meshtron`` in an exported config.json; an import without them takes the
deepseek-v3 preset's."""
PRESET_TRAINING = dict(aux_loss=0.0001, aux_loss_scope="sequence", bias_update=0.001)


def read_deepseek_config(hf: HFConfig, values: dict[str, Any]) -> None:
    """Latent attention in DeepSeek's interleaved rotary layout, no biases; experts from layer
    ``first_k_dense_replace`` on when there are any."""
    hf.require(hf.get("hidden_act") in ("silu", "swish"), f"hidden_act='{hf.get('hidden_act')}'"
               " is not supported (meshtron uses SwiGLU: silu)")
    hf.require(hf.get("rope_interleave") is True, "rope_interleave=false is not supported "
               "(meshtron's latent attention uses DeepSeek's interleaved rotary layout)")
    hf.require(not hf.raw.get("attention_bias"), "attention_bias=true is not supported "
               "(meshtron's latent attention has no biases)")
    heads, kv_heads = values["num_heads"], hf.get("num_key_value_heads")
    hf.require(kv_heads in (None, heads), f"num_key_value_heads={kv_heads} differs from "
               f"num_attention_heads={heads} (latent attention gives every head its keys)")
    q_rank = hf.get("q_lora_rank")
    hf.require(q_rank is None or (isinstance(q_rank, int) and q_rank > 0),
               f"'q_lora_rank' must be a positive integer or null, got {q_rank!r}")
    theta, rope = read_rope(hf, values["rope_theta"], values["max_seq_len"])
    params = hf.raw.get("rope_parameters") or hf.raw.get("rope_scaling") or {}
    mscale_all = params.get("mscale_all_dim") or 0.0
    if rope.scaling != "none" and mscale_all:
        hf.require(isinstance(mscale_all, (int, float)) and mscale_all > 0,
                   f"rope parameter 'mscale_all_dim' must be a positive number, got {mscale_all!r}")
        rope = dataclasses.replace(rope, mscale_all_dim=float(mscale_all))
    mtp = hf.get("num_nextn_predict_layers")
    hf.require(isinstance(mtp, int) and not isinstance(mtp, bool) and mtp >= 0,
               f"'num_nextn_predict_layers' must be a non-negative integer, got {mtp!r}")
    values.update(arch="llama", attention="mla", num_kv_heads=heads, q_lora_rank=q_rank or 0,
                  rope_theta=theta, rope=rope, tie_embeddings=bool(values["tie_embeddings"]),
                  mtp_depth=mtp)
    dense = hf.get("first_k_dense_replace")
    hf.require(isinstance(dense, int) and dense >= 0,
               f"'first_k_dense_replace' must be a non-negative integer, got {dense!r}")
    if dense < values["num_layers"]:
        values["moe"] = _read_experts(hf, dense)


def _read_experts(hf: HFConfig, dense: int) -> MoEConfig:
    experts, top_k = hf.get("n_routed_experts"), hf.get("num_experts_per_tok")
    groups, topk_groups = hf.get("n_group"), hf.get("topk_group")
    shared = hf.get("n_shared_experts")
    hf.require(isinstance(shared, int) and shared > 0,
               f"n_shared_experts={shared!r} is not supported (DeepSeek-V3 always has shared "
               "experts; meshtron needs at least one)")
    hf.require(top_k <= experts, f"num_experts_per_tok={top_k} exceeds n_routed_experts="
               f"{experts}")
    hf.require(experts % groups == 0 and experts // groups >= 2, f"n_group={groups} must split "
               f"n_routed_experts={experts} into groups of at least two experts")
    kept = hf.saved().get("moe")
    kept = kept if isinstance(kept, dict) else {}
    scale = hf.get("routed_scaling_factor")
    hf.require(isinstance(scale, (int, float)) and scale > 0, "'routed_scaling_factor' must be a "
               f"positive number, got {scale!r}")
    moe = MoEConfig(
        num_experts=experts, top_k=top_k, expert_ffn_size=hf.get("moe_intermediate_size"),
        shared_experts=shared, dense_layers=dense, every=1, score="sigmoid",
        normalize_topk=bool(hf.get("norm_topk_prob")), route_scale=float(scale),
        groups=groups, topk_groups=topk_groups, capacity_factor=0.0, pad_to_capacity=False,
        **PRESET_TRAINING)
    return dataclasses.replace(moe, **{k: kept[k] for k in TRAINING_FIELDS if k in kept})


def deepseek_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json fields beyond the table: queries, rotary layout and scaling,
    multi-token-prediction layers, experts."""
    rope = rope_fields(cfg)
    if cfg.rope.mscale_all_dim and rope:
        rope["rope_parameters"]["mscale_all_dim"] = cfg.rope.mscale_all_dim
    out: dict[str, Any] = dict(
        hidden_act="silu", num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank or None,
        rope_interleave=True, attention_bias=False, num_nextn_predict_layers=cfg.mtp_depth,
        **rope)
    moe = cfg.moe
    if not cfg.is_moe:
        return dict(out, first_k_dense_replace=cfg.num_layers)
    return dict(out, first_k_dense_replace=moe.dense_layers, n_routed_experts=moe.num_experts,
                num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.expert_ffn_size,
                n_shared_experts=moe.shared_experts, n_group=moe.groups,
                topk_group=moe.topk_groups, norm_topk_prob=bool(moe.normalize_topk),
                routed_scaling_factor=moe.route_scale)


def refusals(cfg: ModelConfig) -> str | None:
    """What HF DeepSeek-V3's experts cannot compute: softmax scores, layers skipped between
    MoE layers, a capacity, no shared experts, groups of one expert."""
    if not cfg.is_moe:
        return None
    moe = cfg.moe
    checks = (
        (moe.score == "sigmoid", f"model.moe.score={moe.score}"),
        (moe.every == 1, f"model.moe.every={moe.every}"),
        (moe.capacity_factor == 0, f"model.moe.capacity_factor={moe.capacity_factor}"),
        (moe.shared_experts > 0, "model.moe.shared_experts=0"),
        (moe.num_experts // moe.groups >= 2, f"model.moe.groups={moe.groups} (groups of one "
                                             "expert)"),
    )
    refused = [reason for ok, reason in checks if not ok]
    return (f"this model has no Hugging Face DeepSeek-V3 equivalent: {', '.join(refused)}"
            if refused else None)


def unexpected(cfg: ModelConfig, name: str) -> str | None:
    """A layer beyond the decoder's and the multi-token-prediction layers config.json counts
    (``model.layers.61`` of DeepSeek-V3 is its MTP layer): named, not dropped."""
    found = re.match(r"model\.layers\.(\d+)\.", name)
    if found and int(found.group(1)) >= cfg.num_layers + cfg.mtp_depth:
        return (f"holds layer model.layers.{found.group(1)}, beyond the {cfg.num_layers} "
                f"decoder and {cfg.mtp_depth} multi-token-prediction layers its config.json "
                "counts (num_hidden_layers, num_nextn_predict_layers)")
    return None


DEEPSEEK_FORMAT = HFFormat(
    model_types=(HFModelType("deepseek_v3", "DeepSeek-V3", "DeepseekV3ForCausalLM",
                             DEEPSEEK_DEFAULTS),),
    fields=FIELDS, to_config=deepseek_config, from_config=read_deepseek_config,
    layer_prefix="model.layers.{i}.", layer_rules=ATTENTION_RULES + MLP_RULES + EXPERT_RULES,
    global_rules=GLOBAL_RULES, head="lm_head.weight", base_prefix="model.",
    refusals=refusals, unexpected=unexpected, mtp_rules=MTP_RULES,
    mtp_copies=("embed_tokens.weight", "shared_head.head.weight"),
    saved=lambda cfg: ({"moe": {key: getattr(cfg.moe, key) for key in TRAINING_FIELDS}}
                       if cfg.is_moe else {}),
)
DEEPSEEK = dataclasses.replace(
    LLAMA, name="deepseek", attention=LatentAttention, latent=None, experts=None,
    hf=DEEPSEEK_FORMAT, hf_variants=(), notes=("DeepSeek-V2/V3 (with MTP)",),
)
