"""One optimizer step and one evaluation pass.

Loss normalisation follows the parity contract: each micro-batch backpropagates its token-loss
*sum* divided by the token count of the whole global batch, so the accumulated gradient is the
gradient of the global mean loss whatever the micro-batch and data-parallel split.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from meshtron.optim.adamw import set_learning_rate
from meshtron.optim.clip import clip_gradients
from meshtron.optim.grad_sync import global_grad_norm, sync_gradients
from meshtron.parallel.collectives import all_reduce
from meshtron.parallel.mesh import ParallelMesh

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool = False


class Precision:
    """Autocast for bf16/fp16 compute over fp32 weights; dynamic loss scaling for fp16."""

    def __init__(self, dtype: str, device: torch.device):
        self.device = device
        self.dtype = AUTOCAST_DTYPES.get(dtype)
        self.scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()


def micro_batches(batch: torch.Tensor, micro_batch: int) -> list[torch.Tensor]:
    return list(batch.split(micro_batch))


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    local_batch: torch.Tensor,
    mesh: ParallelMesh,
    *,
    global_tokens: int,
    micro_batch: int,
    lr: float,
    grad_clip: float,
    precision: Precision,
) -> StepResult:
    """Forward/backward over this rank's micro-batches, reduce, clip, and update the weights."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float64, device=local_batch.device)
    for mb in micro_batches(local_batch, micro_batch):
        inputs, targets = mb[:, :-1], mb[:, 1:]
        with precision.autocast():
            logits = model(inputs)
        loss = model.loss_sum(logits, targets)
        precision.backward(loss / global_tokens)
        loss_sum += loss.detach().double()
    sync_gradients(params, mesh)
    all_reduce(loss_sum, mesh.dp_cp)
    if precision.scaler is not None:
        precision.scaler.unscale_(optimizer)
    grad_norm = global_grad_norm(params, mesh)
    skipped = not math.isfinite(float(grad_norm))
    if not skipped:
        clip_gradients(params, grad_norm, grad_clip)
    set_learning_rate(optimizer, lr)
    if precision.scaler is not None:
        precision.scaler.step(optimizer)
        precision.scaler.update()
    elif not skipped:
        optimizer.step()
    return StepResult(float(loss_sum) / global_tokens, float(grad_norm), skipped)


@torch.no_grad()
def evaluate(model: nn.Module, local_batches: list[torch.Tensor], micro_batch: int,
             global_tokens: int, mesh: ParallelMesh, precision: Precision) -> float:
    """Mean token loss over the validation batches (this rank holds its dp share of each)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=local_batches[0].device)
    for batch in local_batches:
        for mb in micro_batches(batch, micro_batch):
            with precision.autocast():
                logits = model(mb[:, :-1])
            total += model.loss_sum(logits, mb[:, 1:]).double()
    model.train(was_training)
    return float(all_reduce(total, mesh.dp_cp)) / global_tokens
