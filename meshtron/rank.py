"""One rank's parts, assembled once from the run plan: the model, its optimizer, the precision
policy, the sequence split and the pipeline executor.

Every program that trains (the trainer, the benchmarks, the tests) used to spell the same
chain out by hand: plan -> mesh -> ``Transformer(plan.model, mesh, plan.model_options(...))``
-> ``initialize`` -> cast -> ``build_optimizer`` -> ``SequenceSplit`` -> ``PipelineExecutor``.
The order matters (weights are initialised before the cast, the optimizer is built after it,
ZeRO-3 shards what exists then) and so do the settings (the fp8 amax agreement, the MoE
auxiliary-loss weight that follows the loss scale), so it lives here once:
:func:`build_rank`. :func:`~meshtron.training.step.train_step` and
:func:`~meshtron.training.step.evaluate` take the :class:`Rank` it returns.

This module sits between the optimizer and the checkpoint layers: it imports the plan, the
model, the optimizer, the precision policy and the parallel pieces, and nothing above them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshtron.config import PrecisionConfig
from meshtron.data.builders import row_format
from meshtron.models.adapters import cast_base, seed_base
from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer
from meshtron.optim.data_parallel import DataParallelOptimizer, build_optimizer
from meshtron.parallel.context.sequence import MicroBatch, SequenceSplit, split_sequence
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.pipeline.executor import PipelineExecutor
from meshtron.parallel.tensor.collectives import all_reduce
from meshtron.parallel.tensor.linear import FP8Options
from meshtron.plan import RunPlan
from meshtron.precision.nvfp4 import TokenIndex
from meshtron.precision.policy import PARAM_DTYPES, Precision
from meshtron.precision.recipes import LayerPolicy, fp8_recipe, uses_low_precision


@dataclass(frozen=True)
class Rank:
    """What one rank trains with. Frozen: a new plan (``train.autotune`` changing the
    micro-batch) gives a new :class:`Rank` through :meth:`replanned`, same model and
    optimizer."""

    plan: RunPlan
    mesh: ParallelMesh
    model: Transformer
    optimizer: DataParallelOptimizer
    precision: Precision
    split: Callable[[torch.Tensor], MicroBatch]
    """How this rank cuts token windows into micro-batches (cp chunks, documents, MTP): a
    :class:`SequenceSplit`."""
    pipeline: PipelineExecutor | None
    """The schedule's executor on this pipeline stage (None without a pipeline)."""
    local_params: int
    """Parameters this rank holds before ZeRO-3 shards them (what the start-up report says)."""

    @property
    def micro_batch(self) -> int:
        return self.plan.micro_batch

    @property
    def device(self) -> torch.device:
        return self.precision.device

    def local_share(self, batch: torch.Tensor) -> torch.Tensor:
        """This data-parallel rank's rows of a global batch, on its device."""
        share = self.plan.dp_share
        start = self.mesh.dp.rank * share
        return batch[start : start + share].to(self.device)

    def replanned(self, plan: RunPlan) -> Rank:
        """The same model and optimizer under ``plan`` (its micro-batch; a pipeline gets the
        schedule of its micro-batch count)."""
        pipeline = self.pipeline
        if pipeline is not None:
            pipeline = pipeline_of(plan, self.model, self.mesh)
        return dataclasses.replace(self, plan=plan, pipeline=pipeline)


def build_rank(plan: RunPlan, mesh: ParallelMesh, device: torch.device | None = None, *,
               eos_id: int | None = None,
               load_weights: Callable[[Transformer], None] | None = None) -> Rank:
    """This rank's parts of ``plan`` on ``mesh``: the model of its pipeline stage initialised
    from ``train.seed`` (then ``load_weights``, e.g. a pretrained vision encoder, while the
    weights are still whole and fp32), moved to ``device`` and cast to ``precision.dtype``; the
    optimizer for ``parallel.zero`` with its state created; the sequence split (``eos_id``:
    the tokenizer's end of text, needed by document masks); the pipeline executor."""
    cfg = plan.config
    device = device or torch.device("cpu")
    pc = cfg.precision
    precision = Precision(pc.dtype, device, loss_scaling=pc.loss_scaling,
                          reduce_dtype=pc.reduce_dtype)
    options = plan.model_options(
        mesh.pp.rank, fp8=layer_policy(pc, mesh, cfg.model.num_layers, cfg.train.seed),
        aux_loss_weight=lambda: precision.loss_scale / plan.tokens_per_step)
    model = Transformer(cfg.model, mesh, options)
    initialize(model, seed=cfg.train.seed, std=cfg.model.init_std,
               num_layers=cfg.model.num_layers)
    if load_weights is not None:
        load_weights(model)
    model.to(device).train()
    precision.cast_parameters(model)
    lora = cfg.model.lora
    if lora.enabled:  # the base drawn from the seed until a checkpoint says else
        model.lora_base = seed_base(cfg.model, cfg.train.seed)
        cast_base(model, precision.param_dtype, PARAM_DTYPES[lora.base_dtype or pc.dtype])
    local_params = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(model, mesh, cfg.train, zero=cfg.parallel.zero,
                                bucket_mb=cfg.parallel.bucket_mb,
                                reduce_dtype=precision.reduce_dtype)
    optimizer.init_state()  # torch's AdamW would create it at the first step
    return Rank(plan, mesh, model, optimizer, precision, split_of(plan, mesh, eos_id),
                pipeline_of(plan, model, mesh), local_params)


def rank_with(plan: RunPlan, model: Transformer, optimizer: DataParallelOptimizer,
            mesh: ParallelMesh | None = None, precision: Precision | None = None,
            pipeline: PipelineExecutor | None = None) -> Rank:
    """A :class:`Rank` around a model and optimizer the caller built its own way (a test that
    compares two optimizers on twin models, a benchmark that loads fixed weights): the plan's
    split; ``precision`` by default fp32 on the model's device; ``pipeline`` by default the
    executor of the plan's schedule."""
    mesh = mesh or ParallelMesh.single()
    device = next(model.parameters()).device
    return Rank(plan, mesh, model, optimizer, precision or Precision("fp32", device),
                split_of(plan, mesh), pipeline or pipeline_of(plan, model, mesh),
                sum(p.numel() for p in model.parameters()))


def split_of(plan: RunPlan, mesh: ParallelMesh, eos_id: int | None = None) -> SequenceSplit:
    """How this rank cuts ``plan``'s token windows (``eos_id``: for document masks)."""
    cfg = plan.config
    return SequenceSplit(mesh.cp, cfg.data.document_mask, cfg.data.reset_positions, eos_id,
                         cfg.model.mtp_depth, row_format(cfg.model))


def pipeline_of(plan: RunPlan, model: Transformer,
                mesh: ParallelMesh) -> PipelineExecutor | None:
    """The executor of ``plan``'s schedule for this stage's ``model`` (None without one)."""
    if plan.schedule is None:
        return None
    return PipelineExecutor(model, mesh, plan.partition, plan.schedule, plan.model.hidden_size)


def amax_agreement(mesh: ParallelMesh) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The max of an amax over tp and cp (the ranks that hold parts of the same tensors), so
    every layout scales alike; None on one such rank (block-wise tiles are local to each shard
    and need no agreement)."""
    group = mesh.tp_cp
    if group.pg is None:
        return None
    return lambda amax: all_reduce(amax, group, op=torch.distributed.ReduceOp.MAX)


def fp8_options(pc: PrecisionConfig, mesh: ParallelMesh) -> FP8Options:
    """One layer's FP8 settings (``precision.fp8``), amaxes agreed as :func:`amax_agreement`."""
    return FP8Options(fp8_recipe(pc, amax_agreement(mesh)), pc.fp8_grad)


def layer_policy(pc: PrecisionConfig, mesh: ParallelMesh, num_layers: int,
                 seed: int) -> LayerPolicy | None:
    """Each block's FP8/FP4 options by its index (precision/recipes.py); None when every
    linear layer stays in high precision."""
    if not uses_low_precision(pc):
        return None
    return LayerPolicy(pc, num_layers, seed, amax_agreement(mesh), cp_token_index(mesh))


def cp_token_index(mesh: ParallelMesh) -> TokenIndex | None:
    """Where this cp rank's ``L`` local positions sit in a sequence of ``L * cp`` (its two
    chunks, :func:`split_sequence`); None without context parallelism."""
    rank, cp = mesh.cp.rank, mesh.cp.size
    if cp == 1:
        return None
    return lambda local: (split_sequence(torch.arange(local * cp), rank, cp, dim=0), local * cp)
