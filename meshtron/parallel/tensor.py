"""Tensor- and sequence-parallel layers (Megatron-LM's column/row split, Korthikanti's SP).

Every parameter records how it relates to its global tensor, so that initialisation,
checkpoints and the grad norm never depend on the layout:

``param.global_shape``  shape of the full tensor
``param.shard``         :class:`ShardSpec` of the slice held here (None when not split)
``param.replicas``      how many tp ranks hold an identical copy (counted once in grad norms)
``param.grad_sync``     group over which this parameter's gradient must be summed after
                        backward (replicated weights that only saw part of the data: norms
                        under sequence parallelism, kv heads shared by several ranks)

Communication is explicit: a block calls ``region.enter`` once before its column-parallel
projections and row-parallel layers leave the region themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.parallel.collectives import (
    all_gather,
    all_reduce,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_sp,
)
from meshtron.parallel.linear import FP8Options, linear
from meshtron.parallel.mesh import Group
from meshtron.parallel.weight_grad import WeightGradStore


@dataclass(frozen=True)
class ShardSpec:
    """The slice of a global tensor held by one rank.

    The tensor is viewed as ``parts`` equal blocks along ``dim`` (fused projections such as
    [gate | up]); each block is cut into ``count`` equal pieces and this rank holds piece
    ``index`` of every block, concatenated.
    """

    dim: int
    index: int
    count: int
    parts: int = 1

    def take(self, full: torch.Tensor) -> torch.Tensor:
        blocks = full.chunk(self.parts, dim=self.dim)
        return torch.cat([b.chunk(self.count, dim=self.dim)[self.index] for b in blocks],
                         dim=self.dim)

    def local_shape(self, global_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(global_shape)
        shape[self.dim] //= self.count
        return tuple(shape)


@dataclass(frozen=True)
class TPRegion:
    """How activations enter and leave the tensor-parallel region of a block."""

    group: Group
    sequence_parallel: bool = False

    @property
    def size(self) -> int:
        return self.group.size

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Full-sequence input replicated on every tp rank (gathered under SP)."""
        if self.sequence_parallel:
            return gather_from_sp(x, self.group)
        return copy_to_tp(x, self.group)

    def exit(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum partial outputs over tp (and keep this rank's sequence chunk under SP)."""
        if self.sequence_parallel:
            return reduce_scatter_sp(partial, self.group)
        return reduce_from_tp(partial, self.group)


def describe(param: nn.Parameter, global_shape: tuple[int, ...], shard: ShardSpec | None,
             replicas: int = 1, grad_sync: Group | None = None) -> nn.Parameter:
    param.global_shape = tuple(global_shape)
    param.shard = shard
    param.replicas = replicas
    param.grad_sync = grad_sync if grad_sync is not None and grad_sync.pg is not None else None
    return param


def replicated(param: nn.Parameter, region: TPRegion) -> nn.Parameter:
    """A parameter every tp rank holds whole; under SP each rank sees only part of the
    sequence, so its gradient must be summed over tp."""
    return describe(param, tuple(param.shape), None, region.size,
                    region.group if region.sequence_parallel else None)


def _split(n: int, count: int, what: str) -> int:
    if n % count:
        raise ValueError(f"{what}={n} is not divisible by {count}")
    return n // count


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows; the input must already be in the region.

    ``pieces`` is how many ways the output is split (default: tp). When it is smaller than tp
    (kv heads fewer than tp ranks), groups of tp/pieces ranks share a piece and sum its
    gradient over ``share_group``.
    """

    grad_store: WeightGradStore | None = None
    """Set by :meth:`Transformer.split_weight_grads` for zero-bubble pipelines."""
    fp8: FP8Options | None = None
    """Set by :meth:`Transformer.use_fp8`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, region: TPRegion,
                 parts: int = 1, pieces: int | None = None, share_group: Group | None = None):
        super().__init__()
        pieces = pieces or region.size
        index = region.group.rank * pieces // region.size
        spec = ShardSpec(dim=0, index=index, count=pieces, parts=parts) if pieces > 1 else None
        local_out = _split(out_features, pieces, "output features")
        replicas = region.size // pieces
        self.weight = describe(nn.Parameter(torch.empty(local_out, in_features)),
                               (out_features, in_features), spec, replicas, share_group)
        self.bias = None
        if bias:
            bias_spec = ShardSpec(0, index, pieces, parts) if pieces > 1 else None
            self.bias = describe(nn.Parameter(torch.empty(local_out)), (out_features,),
                                 bias_spec, replicas, share_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.grad_store, self.fp8)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; the output leaves the region (sum over tp),
    then the replicated bias is added once."""

    grad_store: WeightGradStore | None = None
    fp8: FP8Options | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, region: TPRegion):
        super().__init__()
        self.region = region
        spec = ShardSpec(1, region.group.rank, region.size) if region.size > 1 else None
        local_in = _split(in_features, region.size, "input features")
        self.weight = describe(nn.Parameter(torch.empty(out_features, local_in)),
                               (out_features, in_features), spec)
        self.bias = replicated(nn.Parameter(torch.empty(out_features)), region) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.region.exit(linear(x, self.weight, None, self.grad_store, self.fp8))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with its rows (the padded vocabulary) split over tp."""

    def __init__(self, padded_vocab: int, dim: int, region: TPRegion):
        super().__init__()
        self.region = region
        local = _split(padded_vocab, region.size, "padded vocabulary")
        self.start = region.group.rank * local
        spec = ShardSpec(0, region.group.rank, region.size) if region.size > 1 else None
        self.weight = describe(nn.Parameter(torch.empty(local, dim)), (padded_vocab, dim), spec)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.region.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.region.exit(out)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy over logits split by vocabulary; never gathers full logits."""

    @staticmethod
    def forward(ctx, logits, targets, group, start, vocab_size):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        padded = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
        if padded.any():
            logits = logits.masked_fill(padded, float("-inf"))
        maximum = logits.max(dim=-1).values
        all_reduce(maximum, group, torch.distributed.ReduceOp.MAX)
        shifted = logits - maximum.unsqueeze(-1)
        exp = shifted.exp()
        local_target = targets - start
        inside = (local_target >= 0) & (local_target < local_vocab)
        safe = local_target.masked_fill(~inside, 0)
        picked = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        # the sum of exp and the target logit: one all-reduce for both (same bytes, one sync)
        sum_exp, picked = all_reduce(torch.stack([exp.sum(dim=-1), picked]), group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe, inside)
        return sum_exp.log() - picked

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe, inside = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, safe.unsqueeze(-1), -inside.unsqueeze(-1).to(grad.dtype))
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None, None, None


class _CrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy over full logits [tokens, vocab] in fp32: the same values as
    ``F.cross_entropy(reduction="sum")`` with a backward of one pass (softmax - one-hot)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        ctx.save_for_backward(log_probs, targets)
        ctx.dtype = logits.dtype
        return -log_probs.gather(-1, targets.unsqueeze(-1)).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        log_probs, targets = ctx.saved_tensors
        probs = log_probs.exp_()  # in place (a second backward through it raises)
        probs.scatter_add_(-1, targets.unsqueeze(-1), probs.new_full((len(targets), 1), -1.0))
        return probs.mul_(grad).to(ctx.dtype), None


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, group: Group,
                            start: int, vocab_size: int) -> torch.Tensor:
    """Sum of token losses; ``logits`` [.., local vocab] hold columns start..start+local."""
    flat = logits.reshape(-1, logits.shape[-1])
    if group.pg is None:
        return _CrossEntropySum.apply(flat[:, :vocab_size], targets.reshape(-1))
    losses = _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), group, start, vocab_size)
    return losses.sum()


@torch.no_grad()
def gather_full(local: torch.Tensor, spec: ShardSpec | None, group: Group) -> torch.Tensor:
    """Rebuild the global tensor from every tp rank's slice (inverse of ``spec.take``)."""
    if spec is None:
        return local
    gathered = all_gather(local.unsqueeze(0), group, dim=0)
    size = group.size
    pieces = [gathered[i * size // spec.count] for i in range(spec.count)]
    blocks = [piece.chunk(spec.parts, dim=spec.dim) for piece in pieces]
    return torch.cat([torch.cat([b[k] for b in blocks], dim=spec.dim)
                      for k in range(spec.parts)], dim=spec.dim)
