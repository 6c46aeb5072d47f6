"""Parameter counts and FLOPs, from the config and its architecture alone (no model is built).

Used for MFU in the trainer's metrics, by the pipeline's layer balancing and by planning tools
for shapes too big to instantiate. FLOPs follow the Megatron/PaLM convention: 2 FLOPs per
multiply-add, a backward pass costs twice the forward, and attention scores are counted for the
full (not causally halved) s x s matrix, so training FLOPs per token = 6 * (matmul weights) +
6 * layers * seq * heads * (q.k width + value width), which is 12 * layers * seq * heads *
head_dim for multi-head attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtron.config import ModelConfig
from meshtron.models.arch import architecture_of


def padded_vocab_size(cfg: ModelConfig) -> int:
    """Vocabulary rounded up to ``vocab_multiple``: the same under every layout."""
    assert cfg.vocab_size is not None, "model.vocab_size must be resolved before building"
    return math.ceil(cfg.vocab_size / cfg.vocab_multiple) * cfg.vocab_multiple


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


def mlp_matmul_params(cfg: ModelConfig, ffn: int) -> int:
    """One MLP (or expert) of ``ffn`` hidden units: gate, up and down, or up and down."""
    return (3 if architecture_of(cfg).gated_mlp else 2) * cfg.hidden_size * ffn


def model_size(cfg: ModelConfig) -> ModelSize:
    arch = architecture_of(cfg)
    h, ffn, layers = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    vocab = padded_vocab_size(cfg)
    norm = arch.norm_vectors * h
    attention = arch.attention.matmul_params(cfg)
    mlp = mlp_matmul_params(cfg, ffn)
    attention_bias = arch.attention.other_params(cfg, arch.bias)  # biases, norms inside it
    mlp_bias = (2 * ffn if arch.gated_mlp else ffn) + h if arch.bias or cfg.mlp_bias else 0
    dense_layer = attention + mlp + attention_bias + mlp_bias + 2 * norm
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(layers))
    params = (layers - moe_layers) * dense_layer
    matmul = (layers - moe_layers) * (attention + mlp)
    if moe_layers:
        moe = cfg.moe
        shared_ffn = moe.shared_experts * moe.expert_ffn_size
        shared = mlp_matmul_params(cfg, shared_ffn)
        shared_bias = (shared_ffn + h) if arch.bias and shared_ffn else 0
        expert = mlp_matmul_params(cfg, moe.expert_ffn_size)
        router = moe.num_experts * h
        params += moe_layers * (attention + router + moe.num_experts * expert + shared
                                + attention_bias + shared_bias + 2 * norm)
        matmul += moe_layers * (attention + router + moe.top_k * expert + shared)
    embedding = vocab * h + (0 if arch.rotary else cfg.max_seq_len * h)
    output = 0 if cfg.tie_embeddings else vocab * h
    return ModelSize(
        params=embedding + params + norm + output,
        embedding_params=embedding + output,
        matmul_params=matmul + vocab * h,
    )


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs of forward + backward per trained token (see the module docstring)."""
    scores = architecture_of(cfg).attention.score_width(cfg)
    return 6.0 * model_size(cfg).matmul_params + 6.0 * cfg.num_layers * seq_len * scores


def layer_and_head_cost(cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
    """Forward FLOPs per token of one dense transformer layer (attention scores causally
    halved) and of the output layer: the costs the pipeline's layer balancing weighs."""
    attention = architecture_of(cfg).attention
    layer = 2.0 * (attention.matmul_params(cfg) + mlp_matmul_params(cfg, cfg.ffn_hidden_size))
    return (layer + seq_len * attention.score_width(cfg),
            2.0 * cfg.hidden_size * padded_vocab_size(cfg))
