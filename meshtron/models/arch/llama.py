"""Llama: RMSNorm, rotary positions, grouped-query attention, SwiGLU; Hugging Face
``LlamaForCausalLM`` (with its ``attention_bias``, ``mlp_bias``, ``head_dim`` and rope scaling)
and ``MistralForCausalLM`` (a llama with a sliding window).

The llama blocks also carry Qwen's parts (q/k/v-only biases, per-head q/k norms): those
families are :mod:`meshtron.models.arch.qwen`, built from the tables and readers here.
"""

from __future__ import annotations

from typing import Any

from meshtron.config import ModelConfig
from meshtron.models.arch.hf_rope import read_rope, rope_fields
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
    TensorRule(("attn.q.bias",), ("self_attn.q_proj.bias",)),
    TensorRule(("attn.kv.bias",), ("self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    TensorRule(("attn.proj.bias",), ("self_attn.o_proj.bias",)),
    TensorRule(("attn.q_norm.weight",), ("self_attn.q_norm.weight",)),
    TensorRule(("attn.k_norm.weight",), ("self_attn.k_norm.weight",)),
    TensorRule(("attn_norm.weight",), ("input_layernorm.weight",)),
    TensorRule(("mlp_norm.weight",), ("post_attention_layernorm.weight",)),
)
"""Rules whose tensors a model lacks (biases, q/k norms it was not built with) are skipped."""
MLP_RULES = (
    TensorRule(("mlp.gate_up.weight",), ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    TensorRule(("mlp.down.weight",), ("mlp.down_proj.weight",)),
    TensorRule(("mlp.gate_up.bias",), ("mlp.gate_proj.bias", "mlp.up_proj.bias")),
    TensorRule(("mlp.down.bias",), ("mlp.down_proj.bias",)),
)
GLOBAL_RULES = (
    TensorRule(("embed.weight",), ("model.embed_tokens.weight",)),
    TensorRule(("final_norm.weight",), ("model.norm.weight",)),
)
LLAMA_DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
    max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_theta=10000.0, attention_bias=False, mlp_bias=False)
MISTRAL_DEFAULTS = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
    max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, tie_word_embeddings=False,
    sliding_window=4096, rope_theta=10000.0)


def read_blocks(hf: HFConfig, values: dict[str, Any]) -> None:
    """What every llama-block family shares: SwiGLU, the head width, rotary positions;
    completes ``values`` (``model.arch=llama``)."""
    hidden, heads = values["hidden_size"], values["num_heads"]
    hf.require(hf.get("hidden_act") in ("silu", "swish"), f"hidden_act='{hf.get('hidden_act')}'"
               " is not supported (meshtron uses SwiGLU: silu)")
    head_dim = hf.get("head_dim") if "head_dim" in hf.raw or "head_dim" in hf.defaults else None
    if head_dim == hidden // heads and hidden % heads == 0:
        head_dim = None  # the implied width: nothing to say
    theta, rope = read_rope(hf, values["rope_theta"], values["max_seq_len"])
    values.update(arch="llama", num_kv_heads=values["num_kv_heads"] or heads, head_dim=head_dim,
                  rope_theta=theta, rope=rope, tie_embeddings=bool(values["tie_embeddings"]))


def refuse_biases(hf: HFConfig, family: str) -> None:
    """Families whose attention and MLP have no biases: a file saying otherwise is refused
    (transformers would ignore the flag)."""
    for key in ("attention_bias", "mlp_bias"):
        hf.require(not hf.raw.get(key), f"{key}=true is not a {family} setting")


def read_window(hf: HFConfig, values: dict[str, Any]) -> None:
    """Mistral-style: one sliding window over every layer, or none."""
    values["sliding_window"] = hf.get("sliding_window")


def read_llama_config(hf: HFConfig, values: dict[str, Any]) -> None:
    """Llama: ``attention_bias`` puts biases on q, k, v and o; ``mlp_bias`` on the MLP."""
    read_blocks(hf, values)
    attention_bias = bool(hf.get("attention_bias"))
    values.update(qkv_bias=attention_bias, proj_bias=attention_bias,
                  mlp_bias=bool(hf.get("mlp_bias")))


def read_mistral_config(hf: HFConfig, values: dict[str, Any]) -> None:
    read_blocks(hf, values)
    refuse_biases(hf, "Mistral")
    read_window(hf, values)


def block_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json fields every llama-block family writes: activation, head width,
    rope scaling."""
    return dict(hidden_act="silu", head_dim=cfg.head_size, **rope_fields(cfg))


def unmapped(cfg: ModelConfig, family: str, names: tuple[str, ...]) -> str | None:
    """One line naming the settings of ``cfg`` (from ``names``) that HF ``family`` lacks."""
    on = [f"model.{name}" for name in names if getattr(cfg, name)]
    return (f"this model has no Hugging Face {family} equivalent: {', '.join(on)}"
            if on else None)


def llama_refusals(cfg: ModelConfig) -> str | None:
    if cfg.proj_bias and not cfg.qkv_bias:
        return ("this model has no Hugging Face Llama equivalent: model.proj_bias without "
                "model.qkv_bias (Llama's attention_bias sets both)")
    return unmapped(cfg, "Llama", ("qk_norm",))


LLAMA_FORMAT = HFFormat(
    model_types=(HFModelType("llama", "Llama", "LlamaForCausalLM", LLAMA_DEFAULTS),),
    fields=FIELDS,
    to_config=lambda cfg: dict(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias,
                               **block_fields(cfg)),
    from_config=read_llama_config,
    layer_prefix="model.layers.{i}.", layer_rules=ATTENTION_RULES + MLP_RULES,
    global_rules=GLOBAL_RULES, head="lm_head.weight", base_prefix="model.",
    refusals=llama_refusals,
)
MISTRAL_FORMAT = HFFormat(
    model_types=(HFModelType("mistral", "Mistral", "MistralForCausalLM", MISTRAL_DEFAULTS),),
    fields=FIELDS,
    to_config=lambda cfg: dict(sliding_window=cfg.sliding_window, **block_fields(cfg)),
    from_config=read_mistral_config,
    layer_prefix="model.layers.{i}.", layer_rules=ATTENTION_RULES + MLP_RULES,
    global_rules=GLOBAL_RULES, head="lm_head.weight", base_prefix="model.",
    refusals=lambda cfg: unmapped(cfg, "Mistral",
                                  ("qkv_bias", "proj_bias", "mlp_bias", "qk_norm")),
    accepts=lambda cfg: cfg.sliding_window is not None,
)
LLAMA = Architecture(
    name="llama", norm=RMSNorm, norm_vectors=1, rotary=True, gated_mlp=True, bias=False,
    attention=Attention, experts="mixtral", hf=LLAMA_FORMAT, hf_variants=(MISTRAL_FORMAT,),
    notes=("Llama 2/3/3.1, Mistral",),
)
