"""The language-model loss as a token-loss sum, over full or vocabulary-split logits.

Under tensor parallelism each rank holds the logits of its slice of the padded vocabulary; the
cross-entropy is formed from a max and two sums all-reduced over tp (the sum of exponentials
and the target logit travel in one all-reduce), so the full logits are never gathered. Padded
vocabulary entries are masked out and never count, nor do targets below 0 (tokens read but
never predicted, such as a conversation's prompt). Losses compute in fp32, or in fp64 for
fp64 logits.
"""

from __future__ import annotations

import torch

from meshtron.parallel.mesh.groups import Group
from meshtron.parallel.tensor.collectives import all_reduce
from meshtron.precision.policy import at_least_fp32


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy over logits split by vocabulary; never gathers full logits."""

    @staticmethod
    def forward(ctx, logits, targets, group, start, vocab_size):
        logits = logits.to(at_least_fp32(logits.dtype))
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
    """Summed cross-entropy over full logits [tokens, vocab] in fp32 (fp64 for fp64 logits):
    the values of ``F.cross_entropy(reduction="sum")`` with a backward of one pass
    (softmax - one-hot)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(logits, dim=-1, dtype=at_least_fp32(logits.dtype))
        keep = targets >= 0
        safe = targets.clamp(min=0)
        ctx.save_for_backward(log_probs, safe, keep)
        ctx.dtype = logits.dtype
        picked = log_probs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        return -torch.where(keep, picked, torch.zeros_like(picked)).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        log_probs, safe, keep = ctx.saved_tensors
        probs = log_probs.exp_()  # in place (a second backward through it raises)
        probs.scatter_add_(-1, safe.unsqueeze(-1), probs.new_full((len(safe), 1), -1.0))
        # one multiply scales every row and zeroes the skipped ones
        return probs.mul_((grad * keep.to(probs.dtype)).unsqueeze(-1)).to(ctx.dtype), None


def vocab_parallel_loss_sum(logits: torch.Tensor, targets: torch.Tensor, group: Group,
                            start: int, vocab_size: int) -> torch.Tensor:
    """Sum of token losses; ``logits`` [.., local vocab] hold columns start..start+local.
    Targets below 0 (tokens read but never predicted) add nothing and get no gradient."""
    flat, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if group.pg is None:
        return _CrossEntropySum.apply(flat[:, :vocab_size], targets)
    losses = _VocabParallelCrossEntropy.apply(flat, targets, group, start, vocab_size)
    return torch.where(targets >= 0, losses, torch.zeros_like(losses)).sum()
