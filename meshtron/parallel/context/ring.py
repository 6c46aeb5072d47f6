"""Ring attention (pass-KV): the keys and values travel around the cp ring, queries stay.

Each rank holds the queries, keys and values of its two chunks (see :mod:`.sequence`). In cp
steps every rank meets every rank's keys and values: the block in hand is used while the next
one is already on its way (``isend``/``irecv`` to the neighbours, posted before the compute).
Each block gives a partial output and its log-sum-exp (torch's CPU flash-attention kernel where
it applies, else the same math written out), and partial results merge by log-sum-exp (the
online softmax of flash attention), so the attention scores of the whole sequence never exist.
A block whose keys all come after its queries is skipped; the diagonal block uses the causal
mask, and document masks apply per block from the document numbers of the whole sequence.

Backward keeps only this rank's q, k, v, output and log-sum-exp: the key/value blocks go around
the ring again, each with the gradient of its keys and values accumulated by every rank it
visits, and one last hop brings those gradients home. With GQA only the kv heads travel. The
math runs in fp32 (fp64 in fp64 runs): under bf16 the blocks travel in fp32 too.

Bytes per call, for a kv block of B bytes (k and v of this rank's two chunks): forward
(cp − 1)·B, backward (cp − 1)·2B + B, counted as ``cp/send``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtron.parallel.context.sequence import Sequence, attention_mask, split_sequence
from meshtron.parallel.mesh.groups import Group
from meshtron.precision.policy import at_least_fp32

KV_TAG, GRAD_TAG = 1, 2
"""Keys/values and their gradients may be in flight to the same neighbour at once (backward)."""


class _Hop:
    """``payload`` on its way to the next rank of the ring, the previous rank's on its way
    here; :meth:`wait` returns the latter."""

    def __init__(self, payload: torch.Tensor, group: Group, tag: int):
        rank, size = group.rank, group.size
        payload = payload.contiguous()
        self.received = torch.empty_like(payload)
        group.stats.record(group.name, "send", payload.numel() * payload.element_size())
        self.works = [
            dist.isend(payload, group=group.pg, group_dst=(rank + 1) % size, tag=tag),
            dist.irecv(self.received, group=group.pg, group_src=(rank - 1) % size, tag=tag)]
        self.payload = payload  # alive until sent

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


class _Blocks:
    """The (query chunk, key chunk) pairs of this rank's queries against the kv block of a
    source rank, with their masks (None: every key visible)."""

    def __init__(self, group: Group, sequence: Sequence, seq_len: int):
        self.group = group
        self.sequence = sequence
        self.cp = group.size
        self.chunk = seq_len // (2 * self.cp)
        self.index = torch.arange(seq_len, device=sequence.global_index.device)

    def pairs(self, source: int) -> list[tuple[slice, slice, torch.Tensor | None, bool]]:
        """(query slice, key slice, mask or None, diagonal) of every block to compute."""
        c, cp = self.chunk, self.cp
        q_index = self.sequence.global_index
        k_index = split_sequence(self.index, source, cp, dim=0)
        docs = self.sequence.documents
        out = []
        for qc in range(2):
            for kc in range(2):
                qs, ks = slice(qc * c, (qc + 1) * c), slice(kc * c, (kc + 1) * c)
                q_chunk, k_chunk = int(q_index[qs][0]) // c, int(k_index[ks][0]) // c
                if k_chunk > q_chunk:
                    continue  # every key after every query: nothing to attend to
                mask = None
                if k_chunk == q_chunk or docs is not None:
                    mask = attention_mask(q_index[qs], k_index[ks],
                                          None if docs is None else docs[:, q_index[qs]],
                                          None if docs is None else docs[:, k_index[ks]])
                out.append((qs, ks, mask, k_chunk == q_chunk))
        return out


def _fused_kernel(q: torch.Tensor, sequence: Sequence) -> bool:
    """torch's CPU flash-attention kernel returns the log-sum-exp the merge needs; it runs the
    blocks without document masks (a block fully masked by documents needs the math below)."""
    return (q.device.type == "cpu" and sequence.documents is None
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """kv heads repeated for the query heads that share them (GQA)."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Inverse of :func:`_expand` for gradients: summed over the query heads of each kv head."""
    b, heads, length, d = grad.shape
    return grad if heads == kv_heads else grad.view(b, kv_heads, -1, length, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _block_forward(q, k, v, mask, causal: bool, scale: float, fused: bool):
    """(output, log-sum-exp) of q [b, h, cq, d] over one block k, v [b, h, ck, d]; a row that
    sees no key gives output 0 and log-sum-exp -inf."""
    if fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
    scores = _scores(q, k, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return p @ v, lse


def _block_backward(grad, q, k, v, out, lse, delta, mask, causal: bool, scale: float,
                    fused: bool):
    """(dq, dk, dv) of one block, given the whole sequence's output and log-sum-exp."""
    if fused:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, scale=scale)
    p = torch.exp(_scores(q, k, mask, scale) - lse.unsqueeze(-1))
    ds = p * (grad @ v.transpose(-1, -2) - delta) * scale
    return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ grad


def _merge(out, lse, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys, as one."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), 0.0, new)
    weight, weight_b = torch.exp(lse - safe).unsqueeze(-1), torch.exp(lse_b - safe).unsqueeze(-1)
    return out * weight + out_b * weight_b, new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: Group, sequence: Sequence):
        b, heads, length, d = q.shape
        scale, fused = d ** -0.5, _fused_kernel(q, sequence)
        blocks = _Blocks(group, sequence, length * group.size)
        out = torch.zeros_like(q)
        lse = q.new_full((b, heads, length), float("-inf"))
        held = torch.stack([k, v])
        for step in range(group.size):
            source = (group.rank - step) % group.size
            hop = _Hop(held, group, KV_TAG) if step < group.size - 1 else None
            for qs, ks, mask, causal in blocks.pairs(source):
                kb, vb = (_expand(t[..., ks, :], heads) for t in held)
                out_b, lse_b = _block_forward(q[..., qs, :], kb, vb, mask, causal, scale, fused)
                out[..., qs, :], lse[..., qs] = _merge(out[..., qs, :], lse[..., qs], out_b,
                                                       lse_b)
            if hop is not None:
                held = hop.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.sequence, ctx.scale, ctx.fused = group, sequence, scale, fused
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, fused = ctx.group, ctx.scale, ctx.fused
        heads, kv_heads, length = q.shape[1], k.shape[1], q.shape[2]
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1, keepdim=True)
        blocks = _Blocks(group, ctx.sequence, length * group.size)
        dq = torch.zeros_like(q)
        held = torch.stack([k, v])
        grads = torch.zeros_like(held)  # dk, dv of the block held
        for step in range(group.size):
            source = (group.rank - step) % group.size
            hop = _Hop(held, group, KV_TAG) if step < group.size - 1 else None
            for qs, ks, mask, causal in blocks.pairs(source):
                kb, vb = (_expand(t[..., ks, :], heads).contiguous() for t in held)
                dq_b, dk_b, dv_b = _block_backward(
                    grad_out[..., qs, :].contiguous(), q[..., qs, :].contiguous(), kb, vb,
                    out[..., qs, :].contiguous(), lse[..., qs].contiguous(),
                    delta[..., qs, :], mask, causal, scale, fused)
                dq[..., qs, :] += dq_b
                grads[0][..., ks, :] += _fold(dk_b, kv_heads)
                grads[1][..., ks, :] += _fold(dv_b, kv_heads)
            # the gradients follow their block; after the last step they arrive home
            grads = _Hop(grads, group, GRAD_TAG).wait()
            if hop is not None:
                held = hop.wait()
        return dq, grads[0], grads[1], None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                   sequence: Sequence) -> torch.Tensor:
    """Causal attention of this rank's queries q [b, heads, L, d] over the whole sequence, whose
    keys and values k, v [b, kv_heads, L, d] are spread over ``group`` (cp) in chunks."""
    dtype = at_least_fp32(q.dtype)
    out = _RingAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), group, sequence)
    return out.to(q.dtype)
