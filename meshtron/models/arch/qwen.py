"""Qwen2 and Qwen3: llama blocks with q/k/v biases (Qwen2: no output bias) or with per-head
RMSNorms on queries and keys before rotary (Qwen3, whose ``head_dim`` is explicit); Hugging
Face ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``.

Both are variants of the llama architecture (the registry attaches them): a llama model
exports as Qwen3 when it has ``model.qk_norm``, as Qwen2 when it has ``model.qkv_bias``
without ``model.proj_bias``. Their sliding window is one for every layer or none: layer types
mixing full and sliding attention are refused.
"""

from __future__ import annotations

from typing import Any

from meshtron.config import ModelConfig
from meshtron.models.arch.llama import (
    ATTENTION_RULES,
    FIELDS,
    GLOBAL_RULES,
    MLP_RULES,
    block_fields,
    read_blocks,
    unmapped,
)
from meshtron.models.architecture import HFConfig, HFFormat, HFModelType

QWEN_DEFAULTS = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
    max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_theta=10000.0, use_sliding_window=False, sliding_window=4096, max_window_layers=28)
QWEN3_DEFAULTS = dict(QWEN_DEFAULTS, head_dim=128, attention_bias=False)


def read_qwen_window(hf: HFConfig, values: dict[str, Any], per_layer: bool = True) -> None:
    """``use_sliding_window``: the window on layers from ``max_window_layers`` on (or as
    ``layer_types`` says); meshtron has one window for all layers or none."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window is not None and per_layer:
        layers = values["num_layers"]
        first = hf.get("max_window_layers")
        types = hf.raw.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        if all(t == "full_attention" for t in types):
            window = None
        else:
            hf.require(all(t == "sliding_attention" for t in types),
                       "sliding windows on some layers only (layer_types / max_window_layers="
                       f"{first}) are not supported: meshtron has one window for every layer")
    values["sliding_window"] = window


def qwen_window_fields(cfg: ModelConfig) -> dict[str, Any]:
    window = cfg.sliding_window
    return dict(use_sliding_window=window is not None, sliding_window=window,
                max_window_layers=0 if window is not None else cfg.num_layers)


def read_qwen2_config(hf: HFConfig, values: dict[str, Any]) -> None:
    read_blocks(hf, values)
    for key in ("attention_bias", "mlp_bias"):
        hf.require(not hf.raw.get(key), f"{key}=true is not a Qwen2 setting")
    read_qwen_window(hf, values)
    values.update(qkv_bias=True, proj_bias=False)


def read_qwen3_attention(hf: HFConfig, values: dict[str, Any], per_layer: bool) -> None:
    """Qwen3 and Qwen3-MoE attention: q/k norms, ``attention_bias`` on q, k, v and o."""
    read_blocks(hf, values)
    hf.require(not hf.raw.get("mlp_bias"), "mlp_bias=true is not a Qwen3 setting")
    read_qwen_window(hf, values, per_layer)
    attention_bias = bool(hf.get("attention_bias"))
    values.update(qk_norm=True, qkv_bias=attention_bias, proj_bias=attention_bias)


def qwen3_refusals(cfg: ModelConfig, family: str) -> str | None:
    if cfg.qkv_bias != cfg.proj_bias:
        return (f"this model has no Hugging Face {family} equivalent: model.qkv_bias="
                f"{str(cfg.qkv_bias).lower()} with model.proj_bias={str(cfg.proj_bias).lower()} "
                "(its attention_bias sets both)")
    return unmapped(cfg, family, ("mlp_bias",))


QWEN2_FORMAT = HFFormat(
    model_types=(HFModelType("qwen2", "Qwen2", "Qwen2ForCausalLM", QWEN_DEFAULTS),),
    fields=FIELDS,
    to_config=lambda cfg: dict(**block_fields(cfg), **qwen_window_fields(cfg)),
    from_config=read_qwen2_config,
    layer_prefix="model.layers.{i}.", layer_rules=ATTENTION_RULES + MLP_RULES,
    global_rules=GLOBAL_RULES, head="lm_head.weight", base_prefix="model.",
    refusals=lambda cfg: unmapped(cfg, "Qwen2", ("mlp_bias",)),
    accepts=lambda cfg: cfg.qkv_bias and not cfg.proj_bias and not cfg.qk_norm,
)
QWEN3_FORMAT = HFFormat(
    model_types=(HFModelType("qwen3", "Qwen3", "Qwen3ForCausalLM", QWEN3_DEFAULTS),),
    fields=FIELDS,
    to_config=lambda cfg: dict(attention_bias=cfg.qkv_bias, **block_fields(cfg),
                               **qwen_window_fields(cfg)),
    from_config=lambda hf, values: read_qwen3_attention(hf, values, per_layer=True),
    layer_prefix="model.layers.{i}.", layer_rules=ATTENTION_RULES + MLP_RULES,
    global_rules=GLOBAL_RULES, head="lm_head.weight", base_prefix="model.",
    refusals=lambda cfg: qwen3_refusals(cfg, "Qwen3"),
    accepts=lambda cfg: cfg.qk_norm,
)
