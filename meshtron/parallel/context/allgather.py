"""All-gather attention (Llama 3's context parallelism): every rank gathers the keys and values
of the whole sequence and attends its own queries to them.

Simpler than the ring and one collective per direction, at the cost of holding (and keeping for
backward) the whole sequence's keys and values on every rank, which the ring never does. The
gathered rows stay in rank order; the mask compares global positions (and documents), so no
reordering is needed. Backward reduce-scatters the key/value gradients back to their ranks.

Bytes per call, for this rank's k and v block of B bytes: forward all-gather and backward
reduce-scatter of the gathered cp·B, each sending (cp − 1)·B (``cp/all_gather``,
``cp/reduce_scatter``).
"""

from __future__ import annotations

import torch

from meshtron.parallel.context.core import attention_core
from meshtron.parallel.context.sequence import Sequence, attention_mask, split_sequence
from meshtron.parallel.mesh.groups import Group
from meshtron.parallel.tensor.collectives import gather_from_sp


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                         sequence: Sequence) -> torch.Tensor:
    """Causal attention of this rank's q [b, heads, L, d] over the whole sequence, whose k
    [b, kv_heads, L, d] and v [b, kv_heads, L, dv] are spread over ``group`` (cp) in chunks."""
    b, kv_heads, length, d = k.shape
    local = torch.cat([k, v], dim=-1).transpose(1, 2).reshape(b, length, -1)
    gathered = gather_from_sp(local, group)  # [b, cp * L, kv * (d + dv)], ranks in order
    keys, values = gathered.view(b, -1, kv_heads, d + v.shape[-1]).transpose(1, 2).split(
        [d, v.shape[-1]], dim=-1)
    seq = length * group.size
    k_index = torch.cat([split_sequence(torch.arange(seq, device=q.device), r, group.size, 0)
                         for r in range(group.size)])
    docs = sequence.documents
    mask = attention_mask(sequence.global_index, k_index,
                          None if docs is None else docs[:, sequence.global_index],
                          None if docs is None else docs[:, k_index])
    return attention_core(q, keys, values, mask)
