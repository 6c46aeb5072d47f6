"""Parameter counts and FLOPs, from the config and its architecture alone (no model is built).

Used for MFU in the trainer's metrics, by the pipeline's layer balancing and by planning tools
for shapes too big to instantiate. FLOPs follow the Megatron/PaLM convention: 2 FLOPs per
multiply-add, a backward pass costs twice the forward, and attention scores are counted for the
full (not causally halved) s x s matrix, so training FLOPs per token = 6 * (matmul weights) +
6 * layers * seq * heads * (q.k width + value width), which is 12 * layers * seq * heads *
head_dim for multi-head attention. Multi-token-prediction modules count as layers, with their
merge projection and their use of the output head.
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
    """Every parameter, with the padded vocabulary and tied weights counted once (the
    multi-token-prediction modules included)."""
    embedding_params: int
    """Token (and position) embedding parameters, plus an untied output layer."""
    matmul_params: int
    """Weights that take part in a matrix multiply per trained token (the output head
    included; for mixture-of-experts layers the router, the top-k routed and the shared
    experts; the multi-token-prediction modules and their use of the head)."""
    mtp_params: int = 0
    """The multi-token-prediction modules' own parameters (the embedding and head are
    shared): published sizes leave them out (DeepSeek-V3: 671B + 14B)."""
    mtp_matmul_params: int = 0
    """Their share of ``matmul_params``: inference does not run them."""

    @property
    def non_embedding_params(self) -> int:
        return self.params - self.embedding_params


def mlp_matmul_params(cfg: ModelConfig, ffn: int) -> int:
    """One MLP (or expert) of ``ffn`` hidden units: gate, up and down, or up and down."""
    return (3 if architecture_of(cfg).gated_mlp else 2) * cfg.hidden_size * ffn


def layer_size(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(parameters, matmul weights per token) of transformer layer ``layer`` (global index)."""
    arch = architecture_of(cfg)
    h, ffn = cfg.hidden_size, cfg.ffn_hidden_size
    norms = (4 if arch.post_norms else 2) * arch.norm_vectors * h  # post norms: Gemma
    attention = arch.attention.matmul_params(cfg)
    attention_other = arch.attention.other_params(cfg, arch.bias)  # biases, norms inside it
    if not cfg.is_moe_layer(layer):
        mlp = mlp_matmul_params(cfg, ffn)
        mlp_bias = (2 * ffn if arch.gated_mlp else ffn) + h if arch.bias or cfg.mlp_bias else 0
        return attention + mlp + attention_other + mlp_bias + norms, attention + mlp
    moe = cfg.moe
    shared_ffn = moe.shared_experts * moe.expert_ffn_size
    shared = mlp_matmul_params(cfg, shared_ffn)
    shared_bias = (shared_ffn + h) if arch.bias and shared_ffn else 0
    expert = mlp_matmul_params(cfg, moe.expert_ffn_size)
    router = moe.num_experts * h
    params = (attention + router + moe.num_experts * expert + shared + attention_other
              + shared_bias + norms)
    return params, attention + router + moe.top_k * expert + shared


def model_size(cfg: ModelConfig) -> ModelSize:
    arch = architecture_of(cfg)
    h, layers, vocab = cfg.hidden_size, cfg.num_layers, padded_vocab_size(cfg)
    sizes = [layer_size(cfg, i) for i in range(layers + cfg.mtp_depth)]
    # each multi-token-prediction module: its block, three norms, the merge and the head
    mtp_params = sum(p for p, _ in sizes[layers:]) + cfg.mtp_depth * (
        3 * arch.norm_vectors * h + 2 * h * h)
    mtp_matmul = sum(m for _, m in sizes[layers:]) + cfg.mtp_depth * (2 * h * h + vocab * h)
    embedding = vocab * h + (0 if arch.rotary else cfg.max_seq_len * h)
    output = 0 if cfg.tie_embeddings else vocab * h
    return ModelSize(
        params=embedding + sum(p for p, _ in sizes[:layers]) + arch.norm_vectors * h + output
        + mtp_params,
        embedding_params=embedding + output,
        matmul_params=sum(m for _, m in sizes[:layers]) + vocab * h + mtp_matmul,
        mtp_params=mtp_params, mtp_matmul_params=mtp_matmul,
    )


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs of forward + backward per trained token (see the module docstring)."""
    scores = architecture_of(cfg).attention.score_width(cfg)
    layers = cfg.num_layers + cfg.mtp_depth
    return 6.0 * model_size(cfg).matmul_params + 6.0 * layers * seq_len * scores


def attention_cost(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one layer's attention half (projections and scores,
    causally halved): the share of :func:`layer_and_head_cost`'s layer that a pipeline stage
    boundary between a layer's attention and its MLP puts on the earlier stage."""
    attention = architecture_of(cfg).attention
    return 2.0 * attention.matmul_params(cfg) + seq_len * attention.score_width(cfg)


def layer_and_head_cost(cfg: ModelConfig, seq_len: int) -> tuple[float, float]:
    """Forward FLOPs per token of one dense transformer layer (attention scores causally
    halved) and of the output layer with the multi-token-prediction modules (on the last
    stage): the costs the pipeline's layer balancing weighs."""
    layer = attention_cost(cfg, seq_len) + 2.0 * mlp_matmul_params(cfg, cfg.ffn_hidden_size)
    head = 2.0 * cfg.hidden_size * padded_vocab_size(cfg)
    merge = 4.0 * cfg.hidden_size ** 2
    return layer, head + cfg.mtp_depth * (layer + merge + head)
