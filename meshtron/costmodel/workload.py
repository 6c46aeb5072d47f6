"""The work of one transformer layer, by part, on one rank of a layout: FLOPs and GEMM sizes.

Per-token FLOPs come from the same architecture objects and size functions as
:mod:`meshtron.models.flops` (which the trainer's MFU and the pipeline's balancing use), split
into the parts the cost model prices differently: the projections and MLP GEMMs (whose speed
depends on their size), the attention core (a fused kernel, causally halved in time but counted
whole in model FLOPs as Megatron does), the router and the routed experts (top-k, padded to
capacity when the model asks for it), the output layer with the loss. The GEMM sizes follow
from the layout: ``m`` tokens of a micro-batch on this rank (a cp rank holds seq/cp of each
sequence; sequence parallelism gathers the full m before each GEMM), weights split over tp, and
the experts' tokens spread over the local experts of an ep rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.config import ModelConfig
from meshtron.costmodel.candidate import Candidate
from meshtron.models.arch import architecture_of
from meshtron.models.flops import mlp_matmul_params, padded_vocab_size

Shape = tuple[float, float, float]
"""(m rows, n columns, k inner) of one matrix product: an (m, k) by (k, n) product."""


@dataclass(frozen=True)
class Gemm:
    """``count`` matrix multiplies of ``flops`` each (one rank, one micro-batch, forward),
    each made of the products ``shapes`` (their 2mnk add up to ``flops``): a GPU's efficiency
    reads their shapes, and the backward's products are their transposes."""

    flops: float
    count: float = 1.0
    shapes: tuple[Shape, ...] = ()


def gemm(*shapes: Shape, count: float = 1.0) -> Gemm:
    """The Gemm of the products ``shapes`` (m, n, k), run ``count`` times."""
    return Gemm(sum(2.0 * m * n * k for m, n, k in shapes), count, shapes)


def transposed(m: float, n: float, k: float, direction: int) -> Shape:
    """The product of the backward that an (m, n, k) forward product gives: itself
    (``direction`` 0), the input gradient (1: (m, n) by (n, k)), the weight gradient (2: (k, m)
    by (m, n))."""
    return ((m, n, k), (m, k, n), (k, n, m))[direction]


def mlp_shapes(cfg: ModelConfig, tokens: float, width: float) -> tuple[Shape, Shape]:
    """An MLP's two products on ``tokens``: the first (gate and up fused, or up) and the
    down projection, ``width`` hidden units of it on this rank."""
    h = cfg.hidden_size
    first = (3 if architecture_of(cfg).gated_mlp else 2) - 1
    return (tokens, first * width, h), (tokens, h, width)


@dataclass(frozen=True)
class LayerWork:
    """One layer's forward on one rank for one micro-batch."""

    gemms: tuple[Gemm, ...]
    attention_flops: float
    """The attention core's FLOPs as computed (causal: half the score matrix)."""
    elementwise_bytes: float
    """Bytes the memory-bound operators (norms, residuals, rotary, activation) move."""
    score_elements: float = 0.0
    """Elements of the attention's score matrices (every head of this rank, whole s x s):
    what an unfused attention writes and reads in memory."""
    score_gemm_flops: float = 0.0
    """FLOPs of the score product (q.k^T of every head of this rank over the whole sequence):
    the batched GEMM an unfused attention runs, sized as one."""

    @property
    def gemm_flops(self) -> float:
        return sum(g.flops * g.count for g in self.gemms)


def layer_flops_per_token(cfg: ModelConfig, layer: int, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of layer ``layer`` by part, in the Megatron convention (full
    attention scores): three times their sum is the layer's share of
    :func:`meshtron.models.flops.training_flops_per_token`."""
    arch = architecture_of(cfg)
    parts = {"projections": 2.0 * arch.attention.matmul_params(cfg),
             "attention": 2.0 * seq_len * arch.attention.score_width(cfg)}
    if not cfg.is_moe_layer(layer):
        parts["mlp"] = 2.0 * mlp_matmul_params(cfg, cfg.ffn_hidden_size)
        return parts
    moe = cfg.moe
    parts["router"] = 2.0 * moe.num_experts * cfg.hidden_size
    parts["experts"] = 2.0 * moe.top_k * mlp_matmul_params(cfg, moe.expert_ffn_size)
    parts["shared_experts"] = 2.0 * mlp_matmul_params(cfg, moe.shared_experts
                                                      * moe.expert_ffn_size)
    return parts


def head_flops_per_token(cfg: ModelConfig) -> float:
    """The output layer's forward FLOPs per token (the loss's few passes are memory-bound)."""
    return 2.0 * cfg.hidden_size * padded_vocab_size(cfg)


def capacity_padding(cfg: ModelConfig) -> float:
    """How much more the experts compute than their routed tokens: the capacity factor when
    every expert pads to its capacity, else 1."""
    moe = cfg.moe
    return moe.capacity_factor if moe.pad_to_capacity and moe.capacity_factor else 1.0


FP8_CAST_BYTES_PER_ELEMENT = 1.0
"""Beyond the dtype's own reads: an FP8 product's input is read once for its scale (amax)
and once more to be written as one byte per element, its ``2 * element_size + 1`` bytes;
the weights' casts are cached across micro-batches and not counted."""


def layer_work(cfg: ModelConfig, layer: int, seq_len: int, c: Candidate,
               element_size: int, fp8: bool = False) -> LayerWork:
    """The forward of layer ``layer`` for one micro-batch on one rank of ``c``; ``fp8``:
    its products take FP8 inputs, cast (memory-bound) before each of them."""
    arch = architecture_of(cfg)
    m = c.micro_batch * seq_len / c.cp  # tokens of this rank's micro-batch
    h, tp = cfg.hidden_size, c.tp
    attention = arch.attention.matmul_params(cfg)
    out_proj = (cfg.v_head_dim if cfg.latent_attention else cfg.head_size) * cfg.num_heads * h
    gemms = [gemm((m, (attention - out_proj) / (h * tp), h)), gemm((m, h, out_proj / (h * tp)))]
    core = m * seq_len * arch.attention.score_width(cfg) / tp  # causal half of 2*m*s*width
    mlp_width = cfg.ffn_hidden_size
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        gemms.append(gemm((m, moe.num_experts, h)))  # the router, replicated over tp
        local_experts = moe.num_experts / c.ep
        whole = c.etp == 1  # each tp rank routes its 1/tp of the tokens through whole experts
        routed = m * moe.top_k * capacity_padding(cfg) / (tp if whole else 1)
        per_expert = routed * c.ep / moe.num_experts  # tokens one local expert sees
        expert_width = moe.expert_ffn_size / (1 if whole else tp)
        gemms.append(gemm(*mlp_shapes(cfg, per_expert, expert_width), count=local_experts))
        shared = moe.shared_experts * moe.expert_ffn_size
        if shared:
            gemms.append(gemm(*mlp_shapes(cfg, m, shared / tp)))
        mlp_width = moe.top_k * moe.expert_ffn_size + shared
    else:
        gemms.append(gemm(*mlp_shapes(cfg, m, mlp_width / tp)))
    residual = m / tp if c.sp and tp > 1 else m
    elementwise = element_size * (12 * residual * h + 8 * m * h + 6 * m * mlp_width / tp)
    if fp8:  # the inputs of q/kv, the output projection, the MLP's first and last products
        routed = cfg.moe.top_k if cfg.is_moe_layer(layer) else 0
        inputs = m * (h * (2 + routed) + (out_proj / h + mlp_width) / tp)
        elementwise += inputs * (2 * element_size + FP8_CAST_BYTES_PER_ELEMENT)
    heads = cfg.num_heads / tp
    return LayerWork(tuple(gemms), core, elementwise, score_elements=heads * m * seq_len,
                     score_gemm_flops=2.0 * heads * m * seq_len * cfg.head_size)


def head_work(cfg: ModelConfig, seq_len: int, c: Candidate, element_size: int) -> LayerWork:
    """The output layer and the vocabulary-parallel loss for one micro-batch on one rank."""
    m = c.micro_batch * seq_len / c.cp
    vocab = padded_vocab_size(cfg) / c.tp
    return LayerWork((gemm((m, vocab, cfg.hidden_size)),), 0.0,
                     4 * m * vocab * 4 + element_size * 2 * m * cfg.hidden_size)


def mtp_merge_work(cfg: ModelConfig, seq_len: int, c: Candidate) -> LayerWork:
    """One multi-token-prediction module's merge projection (2h -> h, whole on every tp rank)
    for one micro-batch."""
    m = c.micro_batch * seq_len / c.cp
    return LayerWork((gemm((m, cfg.hidden_size, 2 * cfg.hidden_size)),), 0.0, 0.0)
