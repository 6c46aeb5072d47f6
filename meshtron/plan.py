"""The run plan: how one config runs on a given number of ranks, decided and checked once.

:func:`plan_run` turns (config, world size, the tokenizer's vocabulary) into one immutable
:class:`RunPlan`: the mesh layout, the batch split (micro-batch size and count), the padded
vocabulary, the pipeline's layer partition and schedule, and what each rank's model is built
with. Every check that relates config sections to each other, to the architecture or to the
world size is written here once (each config field on its own is checked by
:mod:`meshtron.config.checks`; the mesh's own invariants by
:class:`~meshtron.parallel.mesh.layout.MeshLayout`). The trainer, the CLI, the benchmarks and
the tuner start from a plan; nothing changes a config after it is planned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from meshtron.config import Config, ModelConfig, ParallelConfig, PrecisionConfig
from meshtron.config.checks import require
from meshtron.errors import MeshtronError
from meshtron.models.arch import architecture_of
from meshtron.models.flops import (
    attention_cost,
    layer_and_head_cost,
    padded_vocab_size,
    training_flops_per_token,
)
from meshtron.models.transformer import ModelOptions, no_aux_gradient
from meshtron.models.vision import vision_flops
from meshtron.parallel.mesh.layout import MeshLayout
from meshtron.parallel.pipeline.partition import (
    PipelinePartition,
    check_layer_split,
    partition_layers,
)
from meshtron.parallel.pipeline.schedules import Schedule, build_schedule
from meshtron.parallel.tensor.linear import FP8Options


@dataclass(frozen=True)
class RunPlan:
    """Everything about a run that follows from its config and its world size."""

    config: Config
    """The run's config with the model's vocabulary resolved (what config.yaml records)."""
    layout: MeshLayout
    micro_batch: int
    """Sequences per forward pass on one rank."""
    micro_batches: int
    """Forward passes per optimizer step on one data-parallel rank."""
    padded_vocab: int
    partition: PipelinePartition | None
    """Which layers each pipeline stage holds (None without a pipeline)."""
    schedule: Schedule | None

    @property
    def model(self) -> ModelConfig:
        return self.config.model

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def dp_share(self) -> int:
        """Sequences of each global batch that one data-parallel rank trains on."""
        return self.micro_batch * self.micro_batches

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one global batch whose loss counts (a vision-language-action model's: its
        action tokens only): every micro-batch's loss sum is divided by this count."""
        train, vision = self.config.train, self.config.model.vision
        per_row = vision.action_tokens if vision.enabled else train.seq_len
        return train.global_batch * per_row

    @property
    def input_tokens_per_step(self) -> int:
        """Tokens one global batch feeds the model (image placeholders included)."""
        return self.config.train.global_batch * self.config.train.seq_len

    @property
    def flops_per_step(self) -> float:
        """Model FLOPs of one optimizer step's forward and backward (no recompute): the
        decoder's per token, and a vision model's encoder once per image."""
        train, model = self.config.train, self.config.model
        flops = training_flops_per_token(model, train.seq_len) * self.input_tokens_per_step
        if model.vision.enabled:
            flops += 3.0 * vision_flops(model.vision, model.hidden_size) * train.global_batch
        return flops

    def model_options(self, pp_rank: int, *, fp8: Callable[[], FP8Options] | None = None,
                      aux_loss_weight: Callable[[], float] = no_aux_gradient) -> ModelOptions:
        """What the model of pipeline stage ``pp_rank`` is built with."""
        p = self.config.parallel
        return ModelOptions(
            stage=self.partition.stage_layers(pp_rank) if self.partition else None,
            recompute=self.config.train.recompute, fp8=fp8,
            split_weight_grads=self.schedule is not None and self.schedule.split_backward,
            aux_loss_weight=aux_loss_weight, compile=self.config.train.compile,
            tp_comm_chunks=p.tp_comm_chunks if p.tp_comm_overlap and self.layout.tp > 1 else 0)


def plan_run(cfg: Config, world_size: int, tokenizer_vocab: int | None = None) -> RunPlan:
    """The plan of ``cfg`` on ``world_size`` ranks; the model's vocabulary defaults to the
    tokenizer's ``tokenizer_vocab`` and may not be smaller. Raises :class:`MeshtronError`
    with one sentence for anything that cannot work."""
    return _plan(cfg, world_size, tokenizer_vocab, vocab_known=True)


def _plan(cfg: Config, world_size: int, tokenizer_vocab: int | None,
          vocab_known: bool) -> RunPlan:
    """:func:`plan_run`; ``vocab_known`` False skips the one check that needs the real
    vocabulary (its padded size splitting over tp)."""
    check_model(cfg)
    layout = MeshLayout.of(cfg.parallel, world_size)
    _check_layout(cfg, layout)
    micro_batch, micro_batches = _batch_split(cfg, layout.dp)
    p = cfg.parallel
    schedule = None
    require(p.schedule != "interleaved" or p.vpp >= 2, "parallel.schedule=interleaved needs "
            f"parallel.vpp >= 2 chunks per stage, got {p.vpp}")
    require(p.pp_layers is None or p.pp > 1 or p.vpp > 1, f"parallel.pp_layers={p.pp_layers} is "
            "set but there is no pipeline (parallel.pp=1, parallel.vpp=1)")
    measured = p.zb_v_measured_order
    require(measured == 0 or measured >= 2, f"parallel.zb_v_measured_order={measured} must be 0 "
            "(off) or at least 2 steps (the first step is not timed)")
    if p.pp > 1 or p.vpp > 1:
        check_layer_split(cfg.model, p.pp, p.vpp, p.pp_layers, p.schedule == "zb-v")
        if cfg.train.micro_batch is None:
            micro_batch, micro_batches = _pipeline_micro_batch(cfg, micro_batch)
        schedule = build_schedule(p.schedule, p.pp, p.vpp, micro_batches, p.receives_ahead)
        require(not (schedule.split_backward and p.zero == 3 and layout.dp * p.cp > 1),
                f"parallel.schedule={p.schedule} computes weight gradients after the block's "
                "backward has released its ZeRO-3 parameters; use parallel.zero 0, 1 or 2 with "
                f"{p.schedule}")
        require(not (p.tp_comm_overlap and schedule.split_backward), "parallel.tp_comm_overlap "
                f"does not combine with parallel.schedule={p.schedule} (its split backward "
                "defers weight gradients the overlapped products form at once)")
    for recipe, block in _block_recipes(cfg):
        _check_fp8_blocks(cfg, recipe, block)
    require(not cfg.train.compile or cfg.model.dropout == 0, f"train.compile needs "
            f"model.dropout=0 (got {cfg.model.dropout}): compiled dropout draws other masks "
            "than eager")
    model = _resolve_vocab(cfg.model, tokenizer_vocab)
    if vocab_known:
        _check_vocab_split(model, layout.tp)
    partition = None
    if schedule is not None:
        costs = layer_and_head_cost(model, cfg.train.seq_len)
        encoder = (vision_flops(model.vision, model.hidden_size) / cfg.train.seq_len
                   if model.vision.enabled else 0.0)  # per token, as the layers' costs
        halves = attention_cost(model, cfg.train.seq_len) if p.pp_half_layers else None
        partition = partition_layers(model, p.pp, p.vpp, costs, p.pp_layers, encoder, halves,
                                     schedule.vshape)
        if schedule.vshape:  # zb-v orders its actions by each chunk's cost
            chunk_costs = partition.virtual_stage_costs(
                *costs, attention_cost(model, cfg.train.seq_len), encoder)
            schedule = build_schedule(p.schedule, p.pp, p.vpp, micro_batches, p.receives_ahead,
                                      chunk_costs)
    return RunPlan(dataclasses.replace(cfg, model=model), layout, micro_batch, micro_batches,
                   padded_vocab_size(model), partition, schedule)


def check_run(cfg: Config, world_size: int) -> None:
    """Every check of :func:`plan_run` that can be made before the tokenizer exists: before any
    process starts. The padded vocabulary's split over tp is checked only where
    ``model.vocab_size`` gives it (else the tokenizer decides it, and the trainer's plan
    checks it); the model's vocabulary covering the tokenizer's is the trainer's to check."""
    known = cfg.model.vocab_size is not None
    _plan(cfg, world_size, cfg.model.vocab_size or cfg.model.vocab_multiple, vocab_known=known)


def plan_generation(cfg: Config, world_size: int) -> RunPlan:
    """The plan of generating from ``cfg``'s model on ``world_size`` ranks: one model replica
    (dp = cp = 1, no sequence parallelism, experts split over tp like the MLP), its layers over
    ``parallel.pp`` stages as training splits them. Of ``parallel`` only tp, pp and pp_layers
    are read, of ``precision`` only the dtype; the train section only prices the layer split."""
    p = cfg.parallel
    parallel = ParallelConfig(tp=p.tp, pp=p.pp, pp_layers=p.pp_layers, schedule="gpipe")
    train = dataclasses.replace(cfg.train, global_batch=p.pp, micro_batch=1, recompute="none")
    plan = plan_run(dataclasses.replace(cfg, parallel=parallel, train=train,
                                        precision=PrecisionConfig(dtype=cfg.precision.dtype)),
                    p.tp * p.pp)  # the model splits so (the layout's own message otherwise)
    require(world_size == p.tp * p.pp, f"generation runs one model replica on parallel.tp x "
            f"parallel.pp = {p.tp} x {p.pp} = {p.tp * p.pp} ranks, not {world_size} (set "
            "--nproc to tp x pp)")
    return plan


def check_model(cfg: Config) -> None:
    """What the model needs of its architecture and of the training sequence length."""
    m = cfg.model
    arch = architecture_of(m)
    require(m.latent_attention or m.head_size % 2 == 0 or not arch.rotary, f"the head "
            f"dimension ({m.head_size}: model.head_dim, or hidden_size / num_heads) must be even "
            "for rotary embeddings")  # latent attention's rotary width is checked with it
    require(cfg.train.seq_len <= m.max_seq_len, f"train.seq_len={cfg.train.seq_len} exceeds "
            f"the model's positions (model.max_seq_len={m.max_seq_len})")


def _resolve_vocab(m: ModelConfig, tokenizer_vocab: int | None) -> ModelConfig:
    if m.vocab_size is None:
        if tokenizer_vocab is None:
            raise MeshtronError("model.vocab_size is unset and no tokenizer gives it")
        return dataclasses.replace(m, vocab_size=tokenizer_vocab)
    require(tokenizer_vocab is None or m.vocab_size >= tokenizer_vocab,
            f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer_vocab} tokens")
    return m


def _check_vocab_split(m: ModelConfig, tp: int) -> None:
    """The padded vocabulary (one size under every layout: ``model.vocab_size`` rounded up to
    ``model.vocab_multiple``) splits into equal rows over tp; tp itself need not divide
    ``vocab_multiple`` (49,152 = 384 x 128 splits over 3 ranks)."""
    padded = padded_vocab_size(m)
    if padded % tp == 0:
        return
    fits = ", ".join(str(t) for t in range(1, m.num_heads + 1)
                     if m.num_heads % t == 0 and padded % t == 0)
    raise MeshtronError(
        f"parallel.tp={tp} does not divide the padded vocabulary of {padded} "
        f"(model.vocab_size={m.vocab_size} rounded up to a multiple of "
        f"model.vocab_multiple={m.vocab_multiple}); tp sizes dividing both it and "
        f"model.num_heads={m.num_heads}: {fits}; or set model.vocab_multiple to a multiple "
        f"of {tp}")


def _check_layout(cfg: Config, layout: MeshLayout) -> None:
    """The model and the sequence must split the way the layout cuts them."""
    m, p, t, tp = cfg.model, cfg.parallel, cfg.train, layout.tp
    require(m.num_heads % tp == 0, f"parallel.tp={tp} does not divide model.num_heads="
            f"{m.num_heads}")
    require(m.num_kv_heads % tp == 0 or tp % m.num_kv_heads == 0,
            f"parallel.tp={tp} and model.num_kv_heads={m.num_kv_heads}: one must divide the other")
    require(m.ffn_hidden_size % tp == 0,
            f"parallel.tp={tp} does not divide model.ffn_hidden_size={m.ffn_hidden_size}")
    if m.is_moe:
        e = m.moe.num_experts
        require(e % p.ep == 0, f"parallel.ep={p.ep} does not divide model.moe.num_experts={e}")
        require(p.etp == 1 or m.moe.expert_ffn_size % tp == 0,
                f"parallel.tp={tp} does not divide model.moe.expert_ffn_size="
                f"{m.moe.expert_ffn_size} (experts split over tp like the MLP; parallel.etp=1 "
                "keeps them whole)")
        require(p.etp != 1 or p.sp or t.seq_len % tp == 0,
                f"parallel.etp=1 needs train.seq_len={t.seq_len} divisible by parallel.tp={tp} "
                "(each tp rank routes its share of the sequence)")
    else:
        require(p.ep == 1, f"parallel.ep={p.ep} needs a mixture-of-experts model "
                "(set model.moe.num_experts)")
    if p.sp:
        require(t.seq_len % tp == 0,
                f"parallel.sp needs train.seq_len={t.seq_len} divisible by parallel.tp={tp}")
    if p.tp_comm_overlap:
        _check_overlap(cfg, layout)
    window = m.sliding_window
    require(window is None or window >= m.max_seq_len or layout.cp == 1,
            f"model.sliding_window={window} does not combine with parallel.cp={layout.cp} (the "
            "cp attention paths are causal over the whole sequence)")
    if m.vision.enabled:  # first: a vision model refuses cp outright
        _check_vision_layout(cfg, layout)
    if layout.cp > 1:
        _check_context(cfg, layout)


def _check_overlap(cfg: Config, layout: MeshLayout) -> None:
    """Overlapped tp communication: sequence parallelism whose shares cut into equal pieces."""
    p, chunks = cfg.parallel, cfg.parallel.tp_comm_chunks
    require(p.sp, "parallel.tp_comm_overlap overlaps the sequence-parallel all-gathers and "
            "reduce-scatters: set parallel.sp=true")
    share = cfg.train.seq_len // (layout.cp * layout.tp)
    require(share % chunks == 0, f"parallel.tp_comm_chunks={chunks} does not divide the "
            f"{share} positions of each rank's sequence share (train.seq_len / (cp * tp))")
    pc = cfg.precision
    require(pc.fp8 == "none" and pc.fp4 == "none", "parallel.tp_comm_overlap computes in high "
            f"precision; it does not combine with precision.fp8={pc.fp8} or fp4={pc.fp4}")


def _check_vision_layout(cfg: Config, layout: MeshLayout) -> None:
    """A vision-language-action model: what its observation windows and encoder allow."""
    v, tp = cfg.model.vision, layout.tp
    require(layout.cp == 1, f"parallel.cp={layout.cp} does not combine with model.vision (an "
            "observation window is short; use tp, pp or dp)")
    require(not cfg.model.mtp_depth, "model.mtp_depth does not combine with model.vision "
            "(actions are predicted token by token)")
    require(not (cfg.data.document_mask or cfg.data.reset_positions), "data.document_mask and "
            "data.reset_positions are for text; an observation window is one document")
    require(not cfg.train.eval_generate, "train.eval_generate samples text; a vision model is "
            "measured in closed loop by meshtron evaluate")
    require(v.num_heads % tp == 0, f"parallel.tp={tp} does not divide model.vision.num_heads="
            f"{v.num_heads}")
    require(v.ffn_hidden_size % tp == 0, f"parallel.tp={tp} does not divide "
            f"model.vision.ffn_hidden_size={v.ffn_hidden_size}")


def _check_context(cfg: Config, layout: MeshLayout) -> None:
    """Context parallelism: two equal chunks per cp rank, and what it cannot compose with."""
    m, p, t, cp, tp = cfg.model, cfg.parallel, cfg.train, layout.cp, layout.tp
    require(t.seq_len % (2 * cp) == 0, f"parallel.cp={cp} cuts every sequence into 2*cp = "
            f"{2 * cp} equal chunks: train.seq_len={t.seq_len} is not divisible by {2 * cp}")
    local = t.seq_len // cp
    if p.sp or p.etp == 1:
        require(local % tp == 0, f"train.seq_len / parallel.cp = {local} tokens per cp rank must "
                f"split over parallel.tp={tp} (sequence parallelism or parallel.etp=1)")
    if p.cp_comm == "all_to_all":
        heads, kv = m.num_heads // tp, m.num_kv_heads // min(tp, m.num_kv_heads)
        require(heads % cp == 0, f"parallel.cp_comm=all_to_all splits this rank's {heads} query "
                f"heads (model.num_heads / parallel.tp) over parallel.cp={cp}: not divisible; "
                "use parallel.cp_comm=ring")
        require(kv % cp == 0 or cp % kv == 0, f"parallel.cp_comm=all_to_all needs this rank's "
                f"{kv} kv heads and parallel.cp={cp} to divide one another; use "
                "parallel.cp_comm=ring")
    require(m.dropout == 0, f"parallel.cp={cp} needs model.dropout=0 (attention dropout masks "
            "are not split over cp ranks)")
    require(not (m.is_moe and m.moe.capacity_factor),
            f"parallel.cp={cp} with model.moe.capacity_factor={m.moe.capacity_factor}: each cp "
            "rank would decide drops over its own chunks only; use a dropless MoE "
            "(capacity_factor=0) with context parallelism")
    chunk = t.seq_len // (2 * cp)
    for recipe, block in _block_recipes(cfg):
        # MXFP8's 32-token and NVFP4's 16-token blocks (its Hadamard runs too) are those of
        # one process when no block crosses a cp chunk; block-wise FP8's 128 x 128 tiles are not
        chunked = "blockwise" not in recipe
        require(chunked and chunk % block == 0, f"parallel.cp={cp} with {recipe}: "
                "its weight-gradient tiles run along the tokens that cp splits; use tensorwise "
                "or delayed scaling" + (f", or a train.seq_len that is a multiple of "
                                        f"{2 * cp * block} (2*cp chunks of whole blocks)"
                                        if chunked else ""))


def _batch_split(cfg: Config, dp: int) -> tuple[int, int]:
    """(micro-batch size, micro-batches per step) of one data-parallel rank."""
    t = cfg.train
    require(t.global_batch % dp == 0,
            f"train.global_batch={t.global_batch} is not divisible by the data-parallel size {dp}")
    share = t.global_batch // dp
    micro_batch = t.micro_batch or share
    require(share % micro_batch == 0,
            f"train.global_batch={t.global_batch} is not a multiple of train.micro_batch="
            f"{micro_batch} x data-parallel size {dp}")
    return micro_batch, share // micro_batch


def _pipeline_micro_batch(cfg: Config, share: int) -> tuple[int, int]:
    """Without ``train.micro_batch``, a pipeline takes the largest micro-batch whose count its
    schedule accepts (at least pp micro-batches; for interleaving, a multiple of pp). When none
    does, the schedule's own refusal of one-sequence micro-batches is the error."""
    p = cfg.parallel
    for micro_batch in (d for d in range(share, 1, -1) if share % d == 0):
        try:
            build_schedule(p.schedule, p.pp, p.vpp, share // micro_batch, receives_ahead=0)
        except MeshtronError:
            continue
        return micro_batch, share // micro_batch
    return 1, share


def _block_recipes(cfg: Config) -> list[tuple[str, int]]:
    """The block-scaled recipes of the run (``precision.X=name``) and their block sizes."""
    pc = cfg.precision
    blocks = {"blockwise": pc.fp8_block, "mxfp8": 32, "nvfp4": 16}
    return [(f"precision.{name}={value}", blocks[value])
            for name, value in (("fp8", pc.fp8), ("fp4", pc.fp4)) if value in blocks]


def _check_fp8_blocks(cfg: Config, recipe: str, block: int) -> None:
    """Every tp-local dimension a block-scaled linear layer reduces or produces must be a
    whole number of blocks."""
    m, tp = cfg.model, cfg.parallel.tp
    size = f"precision.fp8_block={block}" if "blockwise" in recipe else f"its block of {block}"
    head_dim = m.head_size
    dims = {"model.hidden_size": m.hidden_size,
            "model.hidden_size / parallel.tp": m.hidden_size // tp,
            "model.ffn_hidden_size / parallel.tp": m.ffn_hidden_size // tp}
    if m.latent_attention:  # the widths its projections reduce or produce on one tp rank
        heads = m.num_heads // tp
        dims.update({
            "model.kv_lora_rank": m.kv_lora_rank,
            "model.kv_lora_rank + model.qk_rope_head_dim": m.kv_lora_rank + m.qk_rope_head_dim,
            "heads per tp rank x (qk_nope_head_dim + v_head_dim)":
                heads * (m.qk_nope_head_dim + m.v_head_dim),
            "heads per tp rank x (qk_nope_head_dim + qk_rope_head_dim)":
                heads * (m.qk_nope_head_dim + m.qk_rope_head_dim),
            "heads per tp rank x v_head_dim": heads * m.v_head_dim})
        if m.q_lora_rank:
            dims["model.q_lora_rank"] = m.q_lora_rank
    else:
        dims["kv heads x head dim per tp rank"] = (m.num_kv_heads * head_dim
                                                   // min(tp, m.num_kv_heads))
    if m.is_moe and "mxfp8" in recipe:  # the routed experts' grouped products too
        etp = 1 if cfg.parallel.etp == 1 else tp
        dims["model.moe.expert_ffn_size per expert-tp rank"] = \
            (m.moe.expert_ffn_size or m.ffn_hidden_size) // etp
        # under ep each source rank's rows are blocked on their own (models/moe.py), as one
        # process blocks that rank's micro-batch; a cp rank's rows are parts of sequences
        require(cfg.parallel.cp == 1, f"{recipe} quantises each expert's weight gradient in "
                f"blocks of 32 of its tokens, which parallel.cp={cfg.parallel.cp} splits "
                "(other blocks than one process); use parallel.cp=1 or tensorwise scaling")
    for name, value in dims.items():
        require(value % block == 0,
                f"{recipe} needs {name} = {value} divisible by {size}; pad the model, or use "
                "tensorwise scaling")
