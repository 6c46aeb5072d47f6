"""GPT-2: LayerNorm, learned absolute positions, GELU (tanh), biases on every linear layer;
Hugging Face ``GPT2LMHeadModel`` (whose Conv1D layers store weights as [in, out])."""

from __future__ import annotations

from typing import Any

from torch import nn

from meshtron.config import ModelConfig
from meshtron.models.architecture import Architecture, HFConfig, HFFormat, HFModelType, TensorRule
from meshtron.models.blocks import Attention

FIELDS = (
    ("num_layers", "n_layer"), ("hidden_size", "n_embd"), ("num_heads", "n_head"),
    ("ffn_hidden_size", "n_inner"), ("max_seq_len", "n_positions"),
    ("norm_eps", "layer_norm_epsilon"), ("tie_embeddings", "tie_word_embeddings"),
)
LAYER_RULES = (
    TensorRule(("attn_norm.weight",), ("ln_1.weight",)),
    TensorRule(("attn_norm.bias",), ("ln_1.bias",)),
    TensorRule(("mlp_norm.weight",), ("ln_2.weight",)),
    TensorRule(("mlp_norm.bias",), ("ln_2.bias",)),
    TensorRule(("attn.q.weight", "attn.kv.weight"), ("attn.c_attn.weight",), transpose=True),
    TensorRule(("attn.q.bias", "attn.kv.bias"), ("attn.c_attn.bias",)),
    TensorRule(("attn.proj.weight",), ("attn.c_proj.weight",), transpose=True),
    TensorRule(("attn.proj.bias",), ("attn.c_proj.bias",)),
    TensorRule(("mlp.up.weight",), ("mlp.c_fc.weight",), transpose=True),
    TensorRule(("mlp.up.bias",), ("mlp.c_fc.bias",)),
    TensorRule(("mlp.down.weight",), ("mlp.c_proj.weight",), transpose=True),
    TensorRule(("mlp.down.bias",), ("mlp.c_proj.bias",)),
)
GLOBAL_RULES = (
    TensorRule(("embed.weight",), ("transformer.wte.weight",)),
    TensorRule(("pos_embed.weight",), ("transformer.wpe.weight",)),
    TensorRule(("final_norm.weight",), ("transformer.ln_f.weight",)),
    TensorRule(("final_norm.bias",), ("transformer.ln_f.bias",)),
)
GPT2_DEFAULTS = dict(
    vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_inner=None, n_positions=1024,
    activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True,
    scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, add_cross_attention=False)


def read_gpt2_config(hf: HFConfig, values: dict[str, Any]) -> None:
    """Refuse what meshtron's GPT-2 blocks cannot compute exactly; complete ``values``."""
    hf.require(hf.get("activation_function") in ("gelu_new", "gelu_pytorch_tanh"),
               f"activation_function='{hf.get('activation_function')}' is not supported "
               "(meshtron's GPT-2 uses the tanh GELU: gelu_new)")
    hf.require(bool(hf.get("scale_attn_weights")) and not hf.get("scale_attn_by_inverse_layer_idx"),
               "GPT-2 attention must be scaled by 1/sqrt(head_dim) only")
    hf.require(not hf.get("add_cross_attention"), "cross-attention is not supported")
    values.update(arch="gpt2", num_kv_heads=values["num_heads"],
                  ffn_hidden_size=values["ffn_hidden_size"] or 4 * values["hidden_size"],
                  tie_embeddings=bool(values["tie_embeddings"]))


def refusals(cfg: ModelConfig) -> str | None:
    if cfg.is_moe:  # Hugging Face's MoE family meshtron writes is Mixtral, llama-based
        return "this mixture-of-experts model has no Hugging Face Mixtral equivalent: " \
               "model.arch=gpt2"
    if cfg.num_kv_heads != cfg.num_heads:
        return (f"a GPT-2 model with num_kv_heads={cfg.num_kv_heads} < num_heads="
                f"{cfg.num_heads} has no Hugging Face equivalent")
    return None


GPT2 = Architecture(
    name="gpt2", norm=nn.LayerNorm, norm_vectors=2, rotary=False, gated_mlp=False, bias=True,
    attention=Attention,
    hf=HFFormat(
        model_types=(HFModelType("gpt2", "GPT-2", "GPT2LMHeadModel", GPT2_DEFAULTS),),
        fields=FIELDS,
        to_config=lambda cfg: dict(
            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False),
        from_config=read_gpt2_config,
        layer_prefix="transformer.h.{i}.", layer_rules=LAYER_RULES, global_rules=GLOBAL_RULES,
        head="lm_head.weight", base_prefix="transformer.", refusals=refusals,
    ),
    notes=("GPT-2, GPT-3 shapes",),
)
