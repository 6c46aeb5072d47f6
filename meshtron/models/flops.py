"""Parameter count and training FLOPs per token, from the config alone (no model is built).

Used for MFU in the trainer's metrics and by planning tools for shapes too big to instantiate.
FLOPs follow the Megatron/PaLM convention: 2 FLOPs per multiply-add, a backward pass costs
twice the forward, and attention scores are counted for the full (not causally halved) s x s
matrix, so training FLOPs per token = 6 * (matmul weights) + 12 * layers * seq * heads * head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.config import ModelConfig
from meshtron.models.transformer import padded_vocab_size


@dataclass(frozen=True)
class ModelSize:
    params: int
    """Every parameter, with the padded vocabulary and tied weights counted once."""
    embedding_params: int
    """Token (and position) embedding parameters, plus an untied output layer."""
    matmul_params: int
    """Weights that take part in a matrix multiply per token (the output head included; for
    mixture-of-experts layers the router, the top-k routed and the shared experts)."""

    @property
    def non_embedding_params(self) -> int:
        return self.params - self.embedding_params


def model_size(cfg: ModelConfig) -> ModelSize:
    h, ffn, layers = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    head_dim = h // cfg.num_heads
    vocab = padded_vocab_size(cfg)
    gpt2 = cfg.arch == "gpt2"
    norm = 2 * h if gpt2 else h
    qkv = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * head_dim
    proj = cfg.num_heads * head_dim * h
    per_ffn_unit = (2 if gpt2 else 3) * h
    mlp = per_ffn_unit * ffn
    layer_bias = ((cfg.num_heads + 2 * cfg.num_kv_heads) * head_dim + h + ffn + h) if gpt2 else 0
    dense_layer = qkv + proj + mlp + layer_bias + 2 * norm
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(layers))
    params = (layers - moe_layers) * dense_layer
    matmul = (layers - moe_layers) * (qkv + proj + mlp)
    if moe_layers:
        moe = cfg.moe
        shared = per_ffn_unit * moe.shared_experts * moe.expert_ffn_size
        shared_bias = (moe.shared_experts * moe.expert_ffn_size + h) if gpt2 else 0
        expert = per_ffn_unit * moe.expert_ffn_size
        attention_bias = layer_bias - (ffn + h if gpt2 else 0)
        router = moe.num_experts * h
        params += moe_layers * (qkv + proj + router + moe.num_experts * expert + shared
                                + attention_bias + shared_bias + 2 * norm)
        matmul += moe_layers * (qkv + proj + router + moe.top_k * expert + shared)
    embedding = vocab * h + (cfg.max_seq_len * h if gpt2 else 0)
    output = 0 if cfg.tie_embeddings else vocab * h
    return ModelSize(
        params=embedding + params + norm + output,
        embedding_params=embedding + output,
        matmul_params=matmul + vocab * h,
    )


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs of forward + backward per trained token (see the module docstring)."""
    attention_width = cfg.num_heads * (cfg.hidden_size // cfg.num_heads)
    return 6.0 * model_size(cfg).matmul_params + 12.0 * cfg.num_layers * seq_len * attention_width
