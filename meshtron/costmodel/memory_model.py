"""Bytes per rank of a layout: what persists between steps, what a step adds, at its peak.

Persistent state follows the optimizers of :mod:`meshtron.optim.data_parallel` (their
``memory_bytes()`` is the check): parameters in the model's dtype, gradient buckets in the
reduction dtype (whole under ZeRO 0/1, the rank's 1/dp chunk under 2/3), fp32 master weights
(none for fp32 parameters, which are updated in place: their own masters) and the
two Adam moments, sharded over the data-parallel group from ZeRO 1 (experts over their own
expert-data-parallel group). Activations are the trainer's per-layer formula
(:func:`meshtron.costmodel.activations.activation_bytes_per_layer`, a close analogue for blocks it
does not cover) times the layers of a chunk times the micro-batches the schedule keeps in
flight on that stage (:meth:`Schedule.peak_in_flight`). Transients are the largest buffers a
step creates on top: the fp32 logits of the loss on the last stage, the gathered units and
gradient buckets of ZeRO-3 (this unit and the prefetched next one) or ZeRO-2 (one unit), and
a pipeline stage's receives posted ahead (``Estimator.posted_receives``).
Under ZeRO a backend that copies a queued reduce-scatter's input (gloo) holds those copies
(of the whole gradient under ZeRO 1, of the two latest buckets under ZeRO 2 and 3, which keep
no more queued) at the end of the backward, when the activations are freed: the step's buffers
at their peak are the larger of the two. An allocator that keeps freed memory (glibc's heap on
a CPU rank) adds the profile's slack per byte of those buffers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtron.config import ModelConfig, ParallelConfig
from meshtron.costmodel.activations import activation_bytes_per_layer, formula_covers
from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.workload import capacity_padding
from meshtron.models.arch import architecture_of
from meshtron.models.flops import layer_size, mlp_matmul_params, model_size, padded_vocab_size
from meshtron.optim.grad_buckets import REDUCE_SCATTERS_IN_FLIGHT


@dataclass(frozen=True)
class StageParams:
    """Parameters one pipeline stage holds, before any tp or ep split."""

    dense: int
    experts: int
    largest_layer: int
    """The biggest transformer layer of the stage (a ZeRO-3 unit)."""
    replicated: int = 0
    """Of ``dense``, what every tp rank holds whole: norms, row-parallel biases, the router,
    latent attention's norms, learned positions."""
    outside_layers: int = 0
    """Of ``dense`` and ``experts``, what lies outside the transformer layers: embedding, final
    norm, output layer, multi-token-prediction modules (ZeRO-3's root unit)."""


def expert_params(cfg: ModelConfig, layer: int) -> int:
    if not cfg.is_moe_layer(layer):
        return 0
    arch = architecture_of(cfg)
    per_expert = mlp_matmul_params(cfg, cfg.moe.expert_ffn_size)
    if arch.bias:
        per_expert += (2 if arch.gated_mlp else 1) * cfg.moe.expert_ffn_size + cfg.hidden_size
    return cfg.moe.num_experts * per_expert


def replicated_params(cfg: ModelConfig, layer: int) -> int:
    """Parameters of one layer that tensor parallelism does not split."""
    arch = architecture_of(cfg)
    h = cfg.hidden_size
    whole = 2 * arch.norm_vectors * h
    if arch.bias or cfg.proj_bias:
        whole += h  # the output projection's bias, added after the reduction
    if cfg.qk_norm:
        whole += 2 * cfg.head_size
    if cfg.latent_attention:
        whole += (cfg.q_lora_rank or 0) + cfg.kv_lora_rank
    if cfg.is_moe_layer(layer):
        whole += cfg.moe.num_experts * h  # the router
        if arch.bias and cfg.moe.shared_experts:
            whole += h
    elif arch.bias or cfg.mlp_bias:
        whole += h  # the MLP's down-projection bias
    return whole


def stage_params(cfg: ModelConfig, layers: list[int], embedding: bool, head: bool,
                 pp: int) -> StageParams:
    """The stage's layers, plus the embedding on the first stage and the final norm, the output
    layer (or the tied embedding's copy when pp > 1) and the multi-token-prediction modules on
    the last."""
    arch = architecture_of(cfg)
    h, vocab = cfg.hidden_size, padded_vocab_size(cfg)
    sizes = [layer_size(cfg, i)[0] for i in layers]
    experts = sum(expert_params(cfg, i) for i in layers)
    dense = sum(sizes) - experts
    positions = 0 if arch.rotary else cfg.max_seq_len * h
    replicated = sum(replicated_params(cfg, i) for i in layers)
    if embedding:
        dense += vocab * h + positions
        replicated += positions
    if head:
        dense += arch.norm_vectors * h
        replicated += arch.norm_vectors * h
        if not cfg.tie_embeddings:
            dense += vocab * h
        elif pp > 1:
            dense += vocab * h  # the tied embedding's copy on the last stage
        if cfg.mtp_depth:
            mtp = list(range(cfg.num_layers, cfg.num_layers + cfg.mtp_depth))
            mtp_experts = sum(expert_params(cfg, i) for i in mtp)
            experts += mtp_experts
            dense += model_size(cfg).mtp_params - mtp_experts
            # each module's three norms and its merge projection (2h -> h) are whole too
            replicated += sum(replicated_params(cfg, i) + 3 * arch.norm_vectors * h + 2 * h * h
                              for i in mtp)
    outside = dense + experts - sum(sizes)
    return StageParams(dense, experts, max(sizes, default=0), replicated, outside)


@dataclass(frozen=True)
class MemoryEstimate:
    params: float
    grads: float
    master: float
    optimizer: float
    activations: float
    transient: float
    reserved: float
    correction: float = 1.0
    collective_copies: float = 0.0
    """The backend's copies of the reduce-scatters queued at the end of the backward."""
    slack: float = 0.0
    """The allocator's retention per byte of the step's buffers."""

    @property
    def state(self) -> float:
        """What the optimizer's ``memory_bytes()`` reports: kept between steps."""
        return self.params + self.grads + self.master + self.optimizer

    @property
    def step_buffers(self) -> float:
        """What a step allocates and frees on top of the state, at its peak."""
        return max(self.activations + self.transient, self.collective_copies)

    @property
    def peak(self) -> float:
        return peak_total(self.state, self.activations, self.transient, self.collective_copies,
                          self.slack, self.correction, self.reserved)


def peak_total(state: float, activations: float, transient: float, copies: float,
               slack: float, correction: float, reserved: float) -> float:
    """:attr:`MemoryEstimate.peak` from its parts, for the search's first pass, which asks
    for 10^5 peaks and reads nothing else of them."""
    return (state + (1 + slack) * max(activations + transient, copies)) * correction + reserved


def rank_params(stage: StageParams, c: Candidate) -> tuple[float, float]:
    """(dense, expert) parameters on one rank of the stage."""
    expert_split = c.ep * (1 if c.etp == 1 else c.tp)
    split = stage.dense - stage.replicated
    return split / c.tp + stage.replicated, stage.experts / expert_split


def state_bytes(stage: StageParams, c: Candidate, param_bytes: int,
                reduce_bytes: int) -> dict[str, float]:
    """Persistent bytes per rank, as the optimizer accounts them (one data-parallel rank runs
    every ZeRO stage as stage 0: there is nothing to shard)."""
    dense, experts = rank_params(stage, c)
    dp = c.dp * c.cp
    zero = c.zero if dp > 1 else 0
    expert_dp = max(1, dp * (c.tp if c.etp == 1 else 1) // c.ep)
    owned = dense / dp + experts / expert_dp  # the 1/dp chunks this rank updates
    total = dense + experts
    own_master = param_bytes >= 4  # fp32 (fp64) parameters are updated in place
    master_bytes = max(4, param_bytes)
    return {
        "params": (owned if zero == 3 else total) * param_bytes,
        "grads": (owned if zero >= 2 else total) * reduce_bytes,
        "master": 0.0 if own_master else (total if zero == 0 else owned) * master_bytes,
        "optimizer": 2 * master_bytes * (total if zero == 0 else owned),
    }


def layer_activation_bytes(cfg: ModelConfig, layer: int, c: Candidate, seq_len: int,
                           element_size: int, selective: str = "core",
                           every: int = 2) -> float:
    """What one layer keeps for backward per micro-batch on one rank; ``selective`` and
    ``every``: what ``selective`` recompute means (:mod:`meshtron.costmodel.recompute`; one
    block in ``every`` kept as under ``full`` is the mean over blocks)."""
    if c.recompute == "selective" and selective == "layers":
        whole, kept = (layer_activation_bytes(cfg, layer, dataclasses.replace(c, recompute=r),
                                              seq_len, element_size) for r in ("full", "none"))
        return (whole + (every - 1) * kept) / every
    local_seq = seq_len // c.cp
    if formula_covers(cfg):
        return activation_bytes_per_layer(cfg, c.micro_batch, local_seq, c.tp, c.sp,
                                          c.recompute, element_size, selective)
    n, h, tp = c.micro_batch * local_seq, cfg.hidden_size, c.tp
    residual = n // tp if c.sp and tp > 1 else n
    if c.recompute == "full":
        return element_size * residual * h
    arch = architecture_of(cfg)
    width = arch.attention.score_width(cfg) / tp  # q.k and value widths over heads
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        units = moe.top_k * moe.expert_ffn_size * capacity_padding(cfg) + \
            moe.shared_experts * moe.expert_ffn_size
        mlp = (4 if arch.gated_mlp else 2) * n * units / tp + 3 * n * moe.top_k * h
    else:
        mlp = (4 if arch.gated_mlp else 2) * n * cfg.ffn_hidden_size / tp
    norm = 2 * (2 * residual * h + n * h)
    attention = 2 * n * width + n * h
    return element_size * (norm + attention + mlp)


def transient_bytes(cfg: ModelConfig, stage: StageParams, c: Candidate, seq_len: int,
                    head: bool, param_bytes: int, reduce_bytes: int) -> float:
    """The largest buffers a step adds on top of state and saved activations."""
    tokens = c.micro_batch * seq_len // c.cp
    logits = 2 * 4 * tokens * padded_vocab_size(cfg) / c.tp if head else 0.0
    unit = stage.largest_layer / c.tp
    if c.zero == 3:
        units = 2 * unit * (param_bytes + reduce_bytes)
    elif c.zero == 2:
        units = unit * reduce_bytes
    else:
        units = 0.0
    return logits + units


def collective_copy_bytes(stage: StageParams, c: Candidate, reduce_bytes: int,
                          copy: float) -> float:
    """The backend's copies of the reduce-scatters queued at once in one backward, on more
    than one data-parallel rank: under ZeRO 1 the rank's whole gradient (every bucket is
    queued before the first is waited for); under ZeRO 2 and 3 the
    :data:`~meshtron.optim.grad_buckets.REDUCE_SCATTERS_IN_FLIGHT` latest buckets (of
    ``parallel.bucket_mb``'s default size; ZeRO 3's buckets are its units: a block, or the
    root of everything outside the blocks). ZeRO 0 all-reduces, which gloo does in place."""
    if c.zero == 0 or c.dp * c.cp == 1:
        return 0.0
    whole = sum(rank_params(stage, c)) * reduce_bytes
    if c.zero == 1:
        return copy * whole
    if c.zero == 2:
        bucket = ParallelConfig().bucket_mb * 2**20
    else:
        bucket = max(stage.largest_layer, stage.outside_layers) / c.tp * reduce_bytes
    return copy * min(whole, REDUCE_SCATTERS_IN_FLIGHT * bucket)


def with_vocab(cfg: ModelConfig, vocab: int | None) -> ModelConfig:
    """The model with its vocabulary size resolved (a preset may leave it to the tokenizer)."""
    return cfg if cfg.vocab_size else dataclasses.replace(cfg, vocab_size=vocab)
