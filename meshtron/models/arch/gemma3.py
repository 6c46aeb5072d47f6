"""Gemma 3: llama-like grouped-query attention with Gemma's own parts, and Hugging Face
``Gemma3ForCausalLM`` (``model_type`` ``gemma3_text``, the text-only model).

Its blocks differ from llama's by spec fields only: RMSNorms scaling by 1 + weight
(:class:`~meshtron.models.norms.OffsetRMSNorm`) before and after both attention and the MLP,
per-head q/k norms, a GELU-gated MLP (tanh approximation), token embeddings times
sqrt(hidden_size). Its settings are model fields: local layers with a sliding window and their
own rotary base between global ones (``sliding_window_pattern``, ``rope_local_theta``; the
global layers take ``rope_theta`` and its scaling), scores scaled by
``query_pre_attn_scalar``, final logits soft-capped (``logit_softcap``). Config files of both
forms read: ``layer_types`` with per-layer-type ``rope_parameters`` (transformers 5), or
``sliding_window_pattern``, ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from meshtron.config import ModelConfig
from meshtron.models.arch.hf_rope import read_rope, rope_fields
from meshtron.models.arch.llama import GLOBAL_RULES, MLP_RULES, unmapped
from meshtron.models.architecture import Architecture, HFConfig, HFFormat, HFModelType, TensorRule
from meshtron.models.blocks import Attention
from meshtron.models.norms import OffsetRMSNorm

FIELDS = (
    ("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
    ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
    ("ffn_hidden_size", "intermediate_size"), ("max_seq_len", "max_position_embeddings"),
    ("norm_eps", "rms_norm_eps"), ("tie_embeddings", "tie_word_embeddings"),
    ("logit_softcap", "final_logit_softcapping"),
)
LAYER_RULES = (
    TensorRule(("attn.q.weight",), ("self_attn.q_proj.weight",)),
    TensorRule(("attn.kv.weight",), ("self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    TensorRule(("attn.proj.weight",), ("self_attn.o_proj.weight",)),
    TensorRule(("attn.q_norm.offset",), ("self_attn.q_norm.weight",)),
    TensorRule(("attn.k_norm.offset",), ("self_attn.k_norm.weight",)),
    TensorRule(("attn_norm.offset",), ("input_layernorm.weight",)),
    TensorRule(("attn_post_norm.offset",), ("post_attention_layernorm.weight",)),
    TensorRule(("mlp_norm.offset",), ("pre_feedforward_layernorm.weight",)),
    TensorRule(("mlp_post_norm.offset",), ("post_feedforward_layernorm.weight",)),
    *MLP_RULES[:2],  # no biases
)
GLOBAL = (GLOBAL_RULES[0], TensorRule(("final_norm.offset",), ("model.norm.weight",)))
GEMMA3_DEFAULTS = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
    tie_word_embeddings=True, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
    final_logit_softcapping=None)
SLIDING, FULL = "sliding_attention", "full_attention"


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh``: GELU with the tanh approximation."""
    return F.gelu(x, approximate="tanh")


def layer_types(hf: HFConfig, layers: int) -> list[str]:
    """Each layer's attention kind: ``layer_types`` as given, else every
    ``sliding_window_pattern``-th layer full and the rest sliding (transformers' rule)."""
    types = hf.raw.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern")
        hf.require(isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0,
                   f"'sliding_window_pattern' must be a positive integer, got {pattern!r}")
        return [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    hf.require(isinstance(types, list) and len(types) == layers
               and all(t in (SLIDING, FULL) for t in types),
               f"'layer_types' must list '{SLIDING}' or '{FULL}' for each of the {layers} layers")
    return types


def read_pattern(hf: HFConfig, values: dict[str, Any]) -> None:
    """``sliding_window`` and ``sliding_window_pattern`` of the layer kinds: no window when
    every layer is full, a window everywhere when none is, else the period of one full layer
    after pattern - 1 sliding ones, which is all meshtron can say."""
    types = layer_types(hf, values["num_layers"])
    window = hf.get("sliding_window")
    pattern = None
    if FULL in types and SLIDING in types:
        pattern = types.index(FULL) + 1
        hf.require(types == [SLIDING if (i + 1) % pattern else FULL for i in range(len(types))],
                   "layer_types that are not one full-attention layer after every "
                   f"{pattern - 1} sliding ones are not supported (meshtron has "
                   "model.sliding_window_pattern)")
    hf.require(SLIDING not in types or window is not None,
               "sliding-attention layers need a 'sliding_window'")
    values.update(sliding_window=window if SLIDING in types else None,
                  sliding_window_pattern=pattern)


def rope_by_kind(hf: HFConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) rope parameters, each with its ``rope_theta``, from either form."""
    params = hf.raw.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full, local = params.get(FULL) or {}, params.get(SLIDING) or {}
        hf.require(isinstance(full, dict) and isinstance(local, dict),
                   "rope_parameters per layer type must be mappings")
        full = {"rope_theta": GEMMA3_DEFAULTS["rope_theta"], **full}
        local = {"rope_theta": GEMMA3_DEFAULTS["rope_local_base_freq"], **local}
        return full, local
    full = dict(params or hf.raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", hf.get("rope_theta"))
    return full, {"rope_theta": hf.get("rope_local_base_freq")}


def read_gemma3_rope(hf: HFConfig, values: dict[str, Any]) -> None:
    """The global layers' base and scaling (read as llama's), the local layers' plain base."""
    full, local = rope_by_kind(hf)
    global_view = HFConfig({**hf.raw, "rope_parameters": full, "rope_scaling": None},
                           hf.defaults, hf.where)
    theta, rope = read_rope(global_view, float(full["rope_theta"]), values["max_seq_len"])
    kind = local.get("rope_type", local.get("type", "default"))
    hf.require(kind == "default", f"rope scaling '{kind}' on the sliding-window layers is not "
               "supported (meshtron scales the global layers' rotary only)")
    local_theta = local["rope_theta"]
    hf.require(isinstance(local_theta, (int, float)) and not isinstance(local_theta, bool)
               and local_theta > 0, f"the local rope_theta must be a positive number, got "
               f"{local_theta!r}")
    values.update(rope_theta=theta, rope=rope, rope_local_theta=float(local_theta))


def read_gemma3_config(hf: HFConfig, values: dict[str, Any]) -> None:
    """Checks what meshtron cannot compute and completes ``values`` (``model.arch=gemma3``)."""
    act = hf.raw.get("hidden_activation", hf.raw.get("hidden_act", "gelu_pytorch_tanh"))
    hf.require(act == "gelu_pytorch_tanh", f"hidden_activation='{act}' is not supported "
               "(meshtron's Gemma 3 gate is gelu_pytorch_tanh)")
    for key in ("attention_bias", "use_bidirectional_attention"):
        hf.require(not hf.raw.get(key), f"{key}=true is not supported")
    hf.require(hf.raw.get("attn_logit_softcapping") is None,
               "attn_logit_softcapping is not supported (meshtron caps the final logits only)")
    scalar = hf.get("query_pre_attn_scalar")
    hf.require(isinstance(scalar, (int, float)) and not isinstance(scalar, bool) and scalar > 0,
               f"'query_pre_attn_scalar' must be a positive number, got {scalar!r}")
    cap = values["logit_softcap"]
    hf.require(cap is None or (isinstance(cap, (int, float)) and cap > 0),
               f"'final_logit_softcapping' must be a positive number, got {cap!r}")
    head_dim = hf.get("head_dim")
    hidden, heads = values["hidden_size"], values["num_heads"]
    read_pattern(hf, values)
    read_gemma3_rope(hf, values)
    values.update(arch="gemma3", qk_norm=True,
                  head_dim=None if head_dim * heads == hidden else head_dim,
                  query_pre_attn_scalar=None if scalar == head_dim else float(scalar),
                  logit_softcap=None if cap is None else float(cap),
                  tie_embeddings=bool(values["tie_embeddings"]))


def number(value: float) -> int | float:
    """An integral value as an int (transformers' Gemma3TextConfig types
    ``query_pre_attn_scalar`` as one)."""
    return int(value) if float(value).is_integer() else value


def gemma3_fields(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's fields beyond the table: layer kinds, per-kind rotary, scalar, width."""
    kinds = [SLIDING if cfg.layer_window(i) is not None else FULL for i in range(cfg.num_layers)]
    full = rope_fields(cfg).get("rope_parameters") or {"rope_type": "default",
                                                      "rope_theta": cfg.rope_theta}
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta}
    scalar = cfg.query_pre_attn_scalar or cfg.head_size
    return dict(head_dim=cfg.head_size, hidden_activation="gelu_pytorch_tanh",
                layer_types=kinds, sliding_window=cfg.sliding_window or cfg.max_seq_len,
                rope_parameters={FULL: full, SLIDING: local},
                query_pre_attn_scalar=number(scalar), attention_bias=False,
                attn_logit_softcapping=None, use_bidirectional_attention=False)


def gemma3_refusals(cfg: ModelConfig) -> str | None:
    if not cfg.qk_norm:
        return ("this model has no Hugging Face Gemma 3 equivalent: it lacks model.qk_norm "
                "(Gemma 3 always normalises queries and keys)")
    if cfg.hidden_size % cfg.num_heads:
        return (f"this model has no Hugging Face Gemma 3 equivalent: transformers needs "
                f"model.hidden_size={cfg.hidden_size} divisible by model.num_heads="
                f"{cfg.num_heads}")
    if cfg.rope.scaling != "none" and cfg.sliding_window is not None \
            and cfg.rope_local_theta is None:
        return ("this model has no Hugging Face Gemma 3 equivalent: model.rope.scaling on its "
                "sliding-window layers (Gemma 3 scales the global layers only; set "
                "model.rope_local_theta)")
    if cfg.is_moe:
        return "this model has no Hugging Face Gemma 3 equivalent: model.moe.num_experts"
    return unmapped(cfg, "Gemma 3", ("qkv_bias", "proj_bias", "mlp_bias"))


GEMMA3_FORMAT = HFFormat(
    model_types=(HFModelType("gemma3_text", "Gemma 3", "Gemma3ForCausalLM", GEMMA3_DEFAULTS),),
    fields=FIELDS,
    to_config=gemma3_fields,
    from_config=read_gemma3_config,
    layer_prefix="model.layers.{i}.", layer_rules=LAYER_RULES, global_rules=GLOBAL,
    head="lm_head.weight", base_prefix="model.",
    refusals=gemma3_refusals,
)
GEMMA3 = Architecture(
    name="gemma3", norm=OffsetRMSNorm, norm_vectors=1, rotary=True, gated_mlp=True,
    bias=False, attention=Attention, gate=gelu_tanh, embed_scale=True, post_norms=True,
    hf=GEMMA3_FORMAT, notes=("Gemma 3 text models (270M, 1B; the text part of 4B-27B)",),
)
