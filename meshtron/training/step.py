"""One optimizer step and one evaluation pass.

Loss normalisation follows the parity contract: each micro-batch backpropagates its token-loss
*sum* divided by the token count of the whole global batch, so the accumulated gradient is the
gradient of the global mean loss whatever the micro-batch and data-parallel split.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function

from meshtron.config import Config
from meshtron.errors import MeshtronError
from meshtron.optim.data_parallel import DataParallelOptimizer
from meshtron.parallel.context.sequence import MicroBatch, SequenceSplit
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.pipeline.executor import PipelineExecutor
from meshtron.parallel.tensor.collectives import all_reduce
from meshtron.precision.policy import Precision

PHASES = ("meshtron.forward_backward", "meshtron.reduce_and_norm", "meshtron.optimizer")
"""The step's parts as ``torch.profiler`` ranges, so a profile splits the step by them."""


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool = False
    compute_s: float = 0.0
    """This rank's forward and backward time before it waits for the gradient reduction (a
    straggler's is longer; what other ranks wait for is not in it, except inside tp/pp)."""


def default_split(model: nn.Module, mesh: ParallelMesh) -> SequenceSplit:
    """The mesh's cp split, no document mask, the model's multi-token-prediction depth."""
    return SequenceSplit(mesh.cp, mtp_depth=model.cfg.mtp_depth)


def micro_batches(batch: torch.Tensor, micro_batch: int,
                  split: SequenceSplit) -> list[MicroBatch]:
    """Windows [rows, S + 1] in micro-batches of ``micro_batch`` rows, as this rank's model
    sees them (its cp chunks, positions and documents)."""
    return [split(window) for window in batch.split(micro_batch)]


def train_step(
    model: nn.Module,
    optimizer: DataParallelOptimizer,
    local_batch: torch.Tensor,
    mesh: ParallelMesh,
    *,
    global_tokens: int,
    micro_batch: int,
    lr: float,
    grad_clip: float,
    precision: Precision,
    pipeline: PipelineExecutor | None = None,
    split: SequenceSplit | None = None,
    poison: bool = False,
    slow_down_s: float = 0.0,
) -> StepResult:
    """Forward/backward over this rank's micro-batches, reduce, clip, and update the weights.

    Gradient buckets are reduced over dp x cp while backward runs (on the last micro-batch, or on
    every one under ZeRO-2); a step whose global grad norm is not finite is skipped everywhere.
    With a ``pipeline`` the micro-batches run through its schedule instead. ``split`` cuts
    sequences over cp and numbers documents (default: the mesh's cp, no document mask).
    A non-finite loss is skipped the same way (both are agreed: the loss is reduced before
    the decision). ``poison`` (a NaN in this rank's loss) and ``slow_down_s`` (extra compute
    time) are injected faults (see :mod:`meshtron.training.faults`).
    """
    started = time.perf_counter()
    optimizer.zero_grad()
    chunks = micro_batches(local_batch, micro_batch, split or default_split(model, mesh))
    scale = precision.loss_scale  # the model's MoE losses read the same weight at forward
    with record_function(PHASES[0]):
        if pipeline is not None:
            loss_sum = pipeline.train(chunks, optimizer, loss_weight=scale / global_tokens)
        else:
            loss_sum = torch.zeros((), dtype=torch.float64, device=local_batch.device)
            for i, mb in enumerate(chunks):
                optimizer.begin_micro_batch(last=i == len(chunks) - 1)
                logits = model(mb.tokens, sequence=mb.sequence, ahead=mb.ahead,
                               inputs=mb.inputs)
                loss = model.loss_sum(logits, mb.targets)
                del logits  # the loss saved what its backward needs: no 2nd vocab-wide copy
                if poison and i == 0:
                    loss = loss * float("nan")
                (loss * (scale / global_tokens)).backward()
                optimizer.end_micro_batch()
                loss_sum += loss.detach().double()
    if slow_down_s > 0:
        time.sleep(slow_down_s)
    compute_s = time.perf_counter() - started
    with record_function(PHASES[1]):
        optimizer.finish_gradients(unscale=1.0 / scale)
        all_reduce(loss_sum, mesh.dp_cp)
        all_reduce(loss_sum, mesh.pp)  # only the last stage has the loss
        grad_norm = float(optimizer.grad_norm())
    skipped = not (math.isfinite(grad_norm) and math.isfinite(float(loss_sum)))
    if precision.scaler is not None:
        precision.scaler.update(overflow=skipped)
    if not skipped:
        with record_function(PHASES[2]):
            optimizer.clip(grad_norm, grad_clip)
            optimizer.update(lr)
    return StepResult(float(loss_sum) / global_tokens, grad_norm, skipped, compute_s)


def too_many_skips(cfg: Config, scaling: bool, consecutive: int, step: int,
                   what: str) -> MeshtronError:
    """The error that ends a run after ``train.max_skipped`` non-finite steps in a row, with
    advice for its precision (loss scaling helps fp16 only)."""
    dtype = cfg.precision.dtype
    if dtype == "fp16" and not scaling:
        advice = "Enable precision.loss_scaling, lower train.lr, or use bf16/fp32"
    elif dtype == "fp16":
        advice = "Lower train.lr or train.grad_clip, use bf16/fp32, or check the data"
    else:
        advice = ("Lower train.lr or train.grad_clip, or check the data; loss scaling is for "
                  "fp16 and would not help here")
    unscaled = " without loss scaling" if dtype == "fp16" and not scaling else ""
    return MeshtronError(
        f"{consecutive} steps in a row up to step {step} were not finite ({what}) in "
        f"{dtype}{unscaled} (train.max_skipped={cfg.train.max_skipped}); they were skipped and "
        f"the weights are those of step {step - consecutive}. {advice}")


@torch.no_grad()
def evaluate(model: nn.Module, local_batches: list[torch.Tensor], micro_batch: int,
             global_tokens: int, mesh: ParallelMesh,
             pipeline: PipelineExecutor | None = None,
             split: SequenceSplit | None = None) -> float:
    """Mean token loss over the validation batches (this rank holds its dp share of each)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=local_batches[0].device)
    split = split or default_split(model, mesh)
    for batch in local_batches:
        chunks = micro_batches(batch, micro_batch, split)
        if pipeline is not None:
            total += pipeline.evaluate(chunks)
            continue
        for mb in chunks:
            logits = model(mb.tokens, sequence=mb.sequence, inputs=mb.inputs)
            total += model.loss_sum(logits, mb.targets).double()
    model.train(was_training)
    all_reduce(total, mesh.pp)
    return float(all_reduce(total, mesh.dp_cp)) / global_tokens
