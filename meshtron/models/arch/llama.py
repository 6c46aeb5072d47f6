"""Llama (and Mistral without a binding sliding window): RMSNorm, rotary positions,
grouped-query attention, SwiGLU, no biases; Hugging Face ``LlamaForCausalLM``."""

from __future__ import annotations

from typing import Any

from meshtron.config import ModelConfig
from meshtron.models.architecture import Architecture, HFConfig, HFFormat, HFModelType, TensorRule
from meshtron.models.blocks import Attention
from meshtron.models.norms import RMSNorm

FIELDS = (
    ("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
    ("num_heads", "num_attention_heads"), ("num_kv_heads", "num_key_value_heads"),
    ("ffn_hidden_size", "intermediate_size"), ("max_seq_len", "max_position_embeddings"),
    ("norm_eps", "rms_norm_eps"), ("rope_theta", "rope_theta"),
    ("tie_embeddings", "tie_word_embeddings"),
)
ATTENTION_RULES = (
    TensorRule(("attn.q.weight",), ("self_attn.q_proj.weight",)),
    TensorRule(("attn.kv.weight",), ("self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    TensorRule(("attn.proj.weight",), ("self_attn.o_proj.weight",)),
    TensorRule(("attn_norm.weight",), ("input_layernorm.weight",)),
    TensorRule(("mlp_norm.weight",), ("post_attention_layernorm.weight",)),
)
MLP_RULES = (
    TensorRule(("mlp.gate_up.weight",), ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    TensorRule(("mlp.down.weight",), ("mlp.down_proj.weight",)),
)
GLOBAL_RULES = (
    TensorRule(("embed.weight",), ("model.embed_tokens.weight",)),
    TensorRule(("final_norm.weight",), ("model.norm.weight",)),
)
LLAMA_DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
    max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
    sliding_window=None, rope_theta=10000.0)
MISTRAL_DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
    max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, tie_word_embeddings=False,
    sliding_window=4096, rope_theta=10000.0)


def rotary_base(hf: HFConfig, default: float) -> float:
    """The rotary base, from ``rope_parameters`` (transformers 5) or the older flat fields
    (``default``: the config class's); scaled or partial rotary embeddings are refused."""
    params = hf.raw.get("rope_parameters") or hf.raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    hf.require(rope_type == "default", f"rope scaling '{rope_type}' is not supported "
               "(meshtron has plain rotary embeddings only)")
    partial = params.get("partial_rotary_factor", hf.raw.get("partial_rotary_factor", 1.0))
    hf.require(partial == 1.0, f"partial_rotary_factor={partial} is not supported")
    return float(params.get("rope_theta", hf.raw.get("rope_theta", default)))


def read_llama_config(hf: HFConfig, values: dict[str, Any]) -> None:
    """Refuse what meshtron's llama blocks cannot compute exactly; complete ``values``."""
    hidden, heads = values["hidden_size"], values["num_heads"]
    hf.require(hf.get("hidden_act") in ("silu", "swish"), f"hidden_act='{hf.get('hidden_act')}'"
               " is not supported (meshtron uses SwiGLU: silu)")
    hf.require(not hf.raw.get("attention_bias") and not hf.raw.get("mlp_bias"),
               "attention or MLP biases are not supported for Llama-style models")
    head_dim = hf.raw.get("head_dim") or hidden // heads
    hf.require(head_dim == hidden // heads, f"head_dim={head_dim} differs from hidden_size / "
               f"num_attention_heads ({hidden} / {heads}), which meshtron requires")
    max_pos, window = values["max_seq_len"], hf.get("sliding_window")
    hf.require(window is None or window >= max_pos, f"sliding_window={window} is shorter than "
               f"max_position_embeddings={max_pos}, and meshtron has no sliding-window attention")
    values.update(arch="llama", num_kv_heads=values["num_kv_heads"] or heads,
                  rope_theta=rotary_base(hf, values["rope_theta"]),
                  tie_embeddings=bool(values["tie_embeddings"]))


def llama_config_extras(cfg: ModelConfig) -> dict[str, Any]:
    return dict(hidden_act="silu", head_dim=cfg.hidden_size // cfg.num_heads)


LLAMA = Architecture(
    name="llama", norm=RMSNorm, norm_vectors=1, rotary=True, gated_mlp=True, bias=False,
    attention=Attention, experts="mixtral",
    hf=HFFormat(
        model_types=(HFModelType("llama", "Llama", "LlamaForCausalLM", LLAMA_DEFAULTS),
                     HFModelType("mistral", "Mistral", "MistralForCausalLM", MISTRAL_DEFAULTS)),
        fields=FIELDS,
        to_config=lambda cfg: dict(attention_bias=False, mlp_bias=False,
                                   **llama_config_extras(cfg)),
        from_config=read_llama_config,
        layer_prefix="model.layers.{i}.", layer_rules=ATTENTION_RULES + MLP_RULES,
        global_rules=GLOBAL_RULES, head="lm_head.weight", base_prefix="model.",
    ),
    notes=("Llama 2/3, Mistral (sliding window off)",),
)
