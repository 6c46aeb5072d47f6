"""Ring attention (pass-KV): the keys and values travel around the cp ring, queries stay.

Each rank holds the queries, keys and values of its two chunks (see :mod:`.sequence`). In cp
steps every rank meets every rank's keys and values: the block in hand is used while the next
one is already on its way (``isend``/``irecv`` to the neighbours, posted before the compute).
Each block gives a partial output and its log-sum-exp (torch's CPU flash-attention kernel where
it applies, else the same math written out), and partial results merge by log-sum-exp (the
online softmax of flash attention), so the attention scores of the whole sequence never exist.
A block whose keys all come after its queries is skipped; the diagonal block uses the causal
mask, and document masks apply per block from the document numbers of the whole sequence.

Backward keeps only this rank's q, its k and v (or latent), output and log-sum-exp: the
key/value blocks go around the ring again, each with the gradient of its keys and values
accumulated by every rank it visits, and one last hop brings those gradients home. With GQA
only the kv heads travel. The math runs in fp32 (fp64 in fp64 runs): under bf16 the blocks
travel in fp32 too.

What travels need not be the keys and values themselves: :func:`ring_attention_of` passes any
block from which each rank makes them (``expand``, differentiated again in backward, so its
gradient travels home as the keys' would). Latent attention sends its normalised latent and
rotated key, (kv_lora_rank + qk_rope_head_dim) values per token instead of heads × (q.k width +
value width), and expands them with its ``kv_b`` weight at every hop: bytes for compute. Keys
and values may differ in width (latent attention's do).

Bytes per call, for a travelling block of B bytes (k and v of this rank's two chunks, side by
side, or what ``expand`` takes): forward (cp − 1)·B, backward (cp − 1)·2B + B, counted as
``cp/send``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

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
        # one batch: NCCL would run a lone send and receive of the same pair (cp=2) one after
        # the other on one stream, each rank's send waiting for the receive queued behind the
        # other's send; batched, they run together (gloo starts them one by one either way)
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, payload, group=group.pg, group_peer=(rank + 1) % size,
                       tag=tag),
            dist.P2POp(dist.irecv, self.received, group=group.pg,
                       group_peer=(rank - 1) % size, tag=tag)])
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


def _fused_kernel(q: torch.Tensor, sequence: Sequence, same_width: bool) -> bool:
    """torch's CPU flash-attention kernel returns the log-sum-exp the merge needs; it runs the
    blocks without document masks (a block fully masked by documents needs the math below)
    and only when keys and values are equally wide (latent attention's are not)."""
    return (q.device.type == "cpu" and sequence.documents is None and same_width
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


Expand = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``expand(held, *params)``: the keys [b, kv_heads, L, dk] and values [b, kv_heads, L, dv]
of one rank's travelling block ``held`` (any shape: it is what goes around the ring)."""


def split_keys_values(held: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The :data:`Expand` of a block that is keys and values side by side: [..., k | v]."""
    k, v = held.split([width, held.shape[-1] - width], dim=-1)
    return k, v


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, held, group: Group, sequence: Sequence, expand: Expand, *params):
        b, heads, length, d = q.shape
        scale = d ** -0.5
        blocks = _Blocks(group, sequence, length * group.size)
        own = held
        for step in range(group.size):
            source = (group.rank - step) % group.size
            hop = _Hop(held, group, KV_TAG) if step < group.size - 1 else None
            keys, values = expand(held, *params)
            if step == 0:
                fused = _fused_kernel(q, sequence, keys.shape[-1] == values.shape[-1])
                out = q.new_zeros(b, heads, length, values.shape[-1])
                lse = q.new_full((b, heads, length), float("-inf"))
            for qs, ks, mask, causal in blocks.pairs(source):
                kb, vb = (_expand(t[..., ks, :], heads) for t in (keys, values))
                out_b, lse_b = _block_forward(q[..., qs, :], kb, vb, mask, causal, scale, fused)
                out[..., qs, :], lse[..., qs] = _merge(out[..., qs, :], lse[..., qs], out_b,
                                                       lse_b)
            if hop is not None:
                held = hop.wait()
        ctx.save_for_backward(q, own, out, lse, *params)
        ctx.group, ctx.sequence, ctx.scale, ctx.fused = group, sequence, scale, fused
        ctx.expand = expand
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, held, out, lse, *params = ctx.saved_tensors
        group, scale, fused, expand = ctx.group, ctx.scale, ctx.fused, ctx.expand
        heads, length = q.shape[1], q.shape[2]
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1, keepdim=True)
        blocks = _Blocks(group, ctx.sequence, length * group.size)
        dq = torch.zeros_like(q)
        grads = torch.zeros_like(held)  # the gradient of the block held
        param_grads = [torch.zeros_like(p) for p in params]
        for step in range(group.size):
            source = (group.rank - step) % group.size
            hop = _Hop(held, group, KV_TAG) if step < group.size - 1 else None
            with torch.enable_grad():  # the expansion again, to carry its gradient back
                leaves = [t.detach().requires_grad_() for t in (held, *params)]
                keys, values = expand(*leaves)
            dk, dv = torch.zeros_like(keys), torch.zeros_like(values)
            kv_heads = keys.shape[1]
            for qs, ks, mask, causal in blocks.pairs(source):
                kb, vb = (_expand(t.detach()[..., ks, :], heads).contiguous()
                          for t in (keys, values))
                dq_b, dk_b, dv_b = _block_backward(
                    grad_out[..., qs, :].contiguous(), q[..., qs, :].contiguous(), kb, vb,
                    out[..., qs, :].contiguous(), lse[..., qs].contiguous(),
                    delta[..., qs, :], mask, causal, scale, fused)
                dq[..., qs, :] += dq_b
                dk[..., ks, :] += _fold(dk_b, kv_heads)
                dv[..., ks, :] += _fold(dv_b, kv_heads)
            d_held, *d_params = torch.autograd.grad((keys, values), leaves, (dk, dv))
            grads += d_held
            for total, part in zip(param_grads, d_params):
                total += part
            # the gradients follow their block; after the last step they arrive home
            grads = _Hop(grads, group, GRAD_TAG).wait()
            if hop is not None:
                held = hop.wait()
        return (dq, grads, None, None, None, *param_grads)


def ring_attention_of(q: torch.Tensor, held: torch.Tensor, expand: Expand,
                      params: tuple[torch.Tensor, ...], group: Group,
                      sequence: Sequence) -> torch.Tensor:
    """Causal attention of this rank's queries q [b, heads, L, d] over the whole sequence,
    whose keys and values are ``expand(held, *params)`` of the blocks ``held`` spread over
    ``group`` (cp) in chunks: the blocks travel, each rank expands every block it meets (and
    ``params`` get this rank's share of their gradient, summed over cp by the caller's
    gradient reduction). The output is [b, heads, L, dv]."""
    dtype = at_least_fp32(q.dtype)
    params = tuple(p.to(dtype) for p in params)
    out = _RingAttention.apply(q.to(dtype), held.to(dtype), group, sequence, expand, *params)
    return out.to(q.dtype)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                   sequence: Sequence) -> torch.Tensor:
    """Causal attention of this rank's queries q [b, heads, L, d] over the whole sequence, whose
    keys k [b, kv_heads, L, d] and values v [b, kv_heads, L, dv] are spread over ``group``
    (cp) in chunks; they travel side by side."""
    dtype = at_least_fp32(q.dtype)
    held = torch.cat([k.to(dtype), v.to(dtype)], dim=-1)
    return ring_attention_of(q, held, partial(split_keys_values, width=k.shape[-1]), (), group,
                             sequence)
