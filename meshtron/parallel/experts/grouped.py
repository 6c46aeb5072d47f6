"""Expert FFN products: the rows of several experts, each times its own weight, in one call.

The rows arrive grouped by expert (see :mod:`.dispatch`). ``torch._grouped_mm`` multiplies all
groups in one kernel where this torch, device and dtype have it; elsewhere one padded batched
matmul does; a per-expert loop is the reference (and the benchmark's peer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def grouped_matmul(x: torch.Tensor, weights: Sequence[torch.Tensor], counts: torch.Tensor,
                   grouped: bool = True) -> torch.Tensor:
    """Rows ``x`` [R, in] in groups of ``counts`` rows, group g times ``weights[g]`` [out, in]
    transposed: [R, out].

    ``torch._grouped_mm`` where this torch has it and the shapes suit it, else one padded
    batched matmul, both on the weights stacked into one tensor; ``grouped=False`` is the
    per-expert loop (the reference and the benchmark's peer).
    """
    if not grouped:
        if len(x) == 0:
            return x.new_zeros(0, weights[0].shape[0])
        return torch.cat([p @ w.t() for p, w in zip(x.split(counts.tolist()), weights)])
    stacked = weights if isinstance(weights, torch.Tensor) else torch.stack(list(weights))
    if _grouped_mm_suits(x, stacked):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        return torch.ops.aten._grouped_mm(x.contiguous(), stacked.transpose(1, 2),
                                          offs=offsets)
    return _padded_bmm(x, stacked, counts)


def _grouped_mm_suits(x: torch.Tensor, weights: torch.Tensor) -> bool:
    """``_grouped_mm`` exists (torch >= 2.8) for this device and dtype, and its 16-byte stride
    rule holds."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return x.dtype == torch.float32 or (
            x.dtype == torch.bfloat16 and all(d * 2 % 16 == 0 for d in weights.shape[1:]))
    return (x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and x.dtype == torch.bfloat16 and all(d * 2 % 16 == 0 for d in weights.shape[1:]))


def _padded_bmm(x: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each group padded to the largest, one ``bmm``, padding dropped."""
    groups, width = weights.shape[0], int(counts.max()) if len(counts) else 0
    slot = torch.arange(width, device=x.device).expand(groups, width)
    valid = slot < counts.unsqueeze(1)
    padded = x.new_zeros(groups, width, x.shape[1])
    padded = padded.masked_scatter(valid.unsqueeze(-1), x)
    out = torch.bmm(padded, weights.transpose(1, 2))
    return out[valid]


def grouped_low_rank(y: torch.Tensor, x: torch.Tensor, a: Sequence[torch.Tensor],
                     b: Sequence[torch.Tensor], counts: torch.Tensor, scale: float,
                     grouped: bool = True) -> torch.Tensor:
    """``y`` plus each group's own low-rank update ``scale * (x A_g^T) B_g^T`` (LoRA on routed
    experts: ``a[g]`` [r, in], ``b[g]`` [out, r]): two grouped products through the rank, so
    an expert's adapter costs r / out of its base product, never a merged [out, in] weight."""
    low = grouped_matmul(x, a, counts, grouped)
    return torch.add(y, grouped_matmul(low, b, counts, grouped), alpha=scale)
