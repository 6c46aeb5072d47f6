"""Ring attention (pass-KV): the keys and values travel around the cp ring, queries stay.

Each rank holds the queries, keys and values of its two chunks (see :mod:`.sequence`). In cp
steps every rank meets every rank's keys and values: the block in hand is used while the next
one is already on its way (``isend``/``irecv`` to the neighbours, posted before the compute).
Partial results merge with the online softmax (running max, sum and weighted values, as in
flash attention), so the attention scores of the whole sequence never exist. A block whose keys
all come after its queries is skipped; the diagonal block uses the causal mask, and document
masks apply per block from the document numbers of the whole sequence.

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

    def pairs(self, source: int) -> list[tuple[slice, slice, torch.Tensor | None]]:
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
                out.append((qs, ks, mask))
        return out


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """q [b, kv, g, cq, d] against k [b, kv, ck, d]: [b, kv, g, cq, ck], masked with -inf."""
    scores = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    return scores


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group: Group, sequence: Sequence):
        b, heads, length, d = q.shape
        kv_heads = k.shape[1]
        scale = d ** -0.5
        qg = q.view(b, kv_heads, heads // kv_heads, length, d)
        blocks = _Blocks(group, sequence, length * group.size)
        m = qg.new_full((*qg.shape[:-1], 1), float("-inf"))
        total = torch.zeros_like(m)
        acc = torch.zeros_like(qg)
        held = torch.stack([k, v])
        for step in range(group.size):
            source = (group.rank - step) % group.size
            hop = _Hop(held, group, KV_TAG) if step < group.size - 1 else None
            for qs, ks, mask in blocks.pairs(source):
                scores = _scores(qg[..., qs, :], held[0][..., ks, :], mask, scale)
                m_new = torch.maximum(m[..., qs, :], scores.amax(-1, keepdim=True))
                safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p = torch.exp(scores - safe)
                alpha = torch.exp(m[..., qs, :] - safe)
                total[..., qs, :] = total[..., qs, :] * alpha + p.sum(-1, keepdim=True)
                acc[..., qs, :] = acc[..., qs, :] * alpha + p @ held[1][..., ks, :].unsqueeze(2)
                m[..., qs, :] = m_new
            if hop is not None:
                held = hop.wait()
        out = acc / total
        lse = m + torch.log(total)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.sequence, ctx.scale = group, sequence, scale
        return out.view(b, heads, length, d)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        b, heads, length, d = q.shape
        kv_heads = k.shape[1]
        qg = q.view(b, kv_heads, heads // kv_heads, length, d)
        dog = grad_out.reshape(qg.shape)
        delta = (dog * out).sum(-1, keepdim=True)
        blocks = _Blocks(group, ctx.sequence, length * group.size)
        dq = torch.zeros_like(qg)
        held = torch.stack([k, v])
        grads = torch.zeros_like(held)  # dk, dv of the block held
        for step in range(group.size):
            source = (group.rank - step) % group.size
            hop = _Hop(held, group, KV_TAG) if step < group.size - 1 else None
            for qs, ks, mask in blocks.pairs(source):
                kb, vb = held[0][..., ks, :], held[1][..., ks, :]
                p = torch.exp(_scores(qg[..., qs, :], kb, mask, scale) - lse[..., qs, :])
                grads[1][..., ks, :] += (p.transpose(-1, -2) @ dog[..., qs, :]).sum(2)
                dp = dog[..., qs, :] @ vb.unsqueeze(2).transpose(-1, -2)
                ds = p * (dp - delta[..., qs, :]) * scale
                dq[..., qs, :] += ds @ kb.unsqueeze(2)
                grads[0][..., ks, :] += (ds.transpose(-1, -2) @ qg[..., qs, :]).sum(2)
            # the gradients follow their block; after the last step they arrive home
            grads = _Hop(grads, group, GRAD_TAG).wait()
            if hop is not None:
                held = hop.wait()
        return dq.view(b, heads, length, d), grads[0], grads[1], None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                   sequence: Sequence) -> torch.Tensor:
    """Causal attention of this rank's queries q [b, heads, L, d] over the whole sequence, whose
    keys and values k, v [b, kv_heads, L, d] are spread over ``group`` (cp) in chunks."""
    dtype = at_least_fp32(q.dtype)
    out = _RingAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), group, sequence)
    return out.to(q.dtype)
