"""One optimizer step and one evaluation pass.

Loss normalisation follows the parity contract: each micro-batch backpropagates its token-loss
*sum* divided by the token count of the whole global batch, so the accumulated gradient is the
gradient of the global mean loss whatever the micro-batch and data-parallel split. Only tokens
whose loss counts are counted (a conversation's answers: :func:`loss_tokens`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from meshtron.parallel.context.sequence import MicroBatch, SequenceSplit
from meshtron.parallel.tensor.collectives import all_reduce
from meshtron.rank import Rank

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
    loss_tokens: float = 0.0
    """Tokens of the global batch whose loss counts (the loss is their mean)."""


def micro_batches(batch: torch.Tensor, micro_batch: int,
                  split: SequenceSplit) -> list[MicroBatch]:
    """Windows [rows, S + 1] in micro-batches of ``micro_batch`` rows, as this rank's model
    sees them (its cp chunks, positions and documents)."""
    return [split(window) for window in batch.split(micro_batch)]


def loss_tokens(rank: Rank, chunks: list[MicroBatch], batches: int = 1) -> float:
    """The count every loss sum of ``batches`` global batches is divided by: the tokens whose
    loss counts. Fixed by the plan, except for conversations, whose answers' share of a batch
    varies: their targets that count are summed over this rank's micro-batches and over
    dp x cp (every pipeline stage holds the targets and sums alike), so the step's loss is the
    global weighted mean whatever the layout."""
    if rank.plan.config.data.format != "chat":
        return float(batches * rank.plan.tokens_per_step)
    count = torch.zeros((), dtype=torch.float64, device=chunks[0].targets.device)
    for mb in chunks:
        count += (mb.targets >= 0).sum()
    return max(float(all_reduce(count, rank.mesh.dp_cp)), 1.0)


def train_step(rank: Rank, local_batch: torch.Tensor, lr: float) -> StepResult:
    """Forward/backward over this rank's micro-batches, reduce, clip, and update the weights.

    Gradient buckets are reduced over dp x cp while backward runs (on the last micro-batch, or on
    every one under ZeRO-2); a step whose global grad norm is not finite is skipped everywhere.
    With a pipeline the micro-batches run through its schedule instead. The plan gives the
    micro-batch size, the global token count every loss sum is divided by and the gradient
    clip. A non-finite loss is skipped the same way (both are agreed: the loss is reduced
    before the decision); :mod:`meshtron.training.faults` causes one by wrapping the loss.
    """
    model, optimizer, precision = rank.model, rank.optimizer, rank.precision
    started = time.perf_counter()
    optimizer.zero_grad()
    chunks = micro_batches(local_batch, rank.micro_batch, rank.split)
    global_tokens = loss_tokens(rank, chunks)
    scale = precision.loss_scale  # the model's MoE losses read the same weight at forward
    with record_function(PHASES[0]):
        if rank.pipeline is not None:
            loss_sum = rank.pipeline.train(chunks, optimizer, loss_weight=scale / global_tokens)
        else:
            loss_sum = torch.zeros((), dtype=torch.float64, device=local_batch.device)
            for i, mb in enumerate(chunks):
                optimizer.begin_micro_batch(last=i == len(chunks) - 1)
                logits = model(mb.tokens, sequence=mb.sequence, ahead=mb.ahead,
                               inputs=mb.inputs)
                loss = model.loss_sum(logits, mb.targets)
                del logits  # the loss saved what its backward needs: no 2nd vocab-wide copy
                (loss * (scale / global_tokens)).backward()
                optimizer.end_micro_batch()
                loss_sum += loss.detach().double()
    compute_s = time.perf_counter() - started
    with record_function(PHASES[1]):
        optimizer.finish_gradients(unscale=1.0 / scale)
        all_reduce(loss_sum, rank.mesh.dp_cp)
        all_reduce(loss_sum, rank.mesh.pp)  # only the last stage has the loss
        grad_norm = float(optimizer.grad_norm())
    skipped = not (math.isfinite(grad_norm) and math.isfinite(float(loss_sum)))
    if precision.scaler is not None:
        precision.scaler.update(overflow=skipped)
    if not skipped:
        with record_function(PHASES[2]):
            optimizer.clip(grad_norm, rank.plan.config.train.grad_clip)
            optimizer.update(lr)
    return StepResult(float(loss_sum) / global_tokens, grad_norm, skipped, compute_s,
                      global_tokens)


@torch.no_grad()
def evaluate(rank: Rank, local_batches: list[torch.Tensor]) -> float:
    """Mean token loss over the validation batches (this rank holds its dp share of each), of
    the tokens whose loss counts as in training."""
    model, mesh = rank.model, rank.mesh
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=local_batches[0].device)
    every: list[MicroBatch] = []
    for batch in local_batches:
        chunks = micro_batches(batch, rank.micro_batch, rank.split)
        every += chunks
        if rank.pipeline is not None:
            total += rank.pipeline.evaluate(chunks)
            continue
        for mb in chunks:
            logits = model(mb.tokens, sequence=mb.sequence, inputs=mb.inputs)
            total += model.loss_sum(logits, mb.targets).double()
    model.train(was_training)
    all_reduce(total, mesh.pp)
    global_tokens = loss_tokens(rank, every, len(local_batches))
    return float(all_reduce(total, mesh.dp_cp)) / global_tokens
