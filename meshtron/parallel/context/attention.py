"""The attention of one block over whole sequences, whatever the cp split and the masks."""

from __future__ import annotations

from types import MappingProxyType

import torch

from meshtron.parallel.context.allgather import all_gather_attention
from meshtron.parallel.context.core import attention_core
from meshtron.parallel.context.ring import ring_attention
from meshtron.parallel.context.sequence import Sequence, attention_mask
from meshtron.parallel.context.ulysses import all_to_all_attention
from meshtron.parallel.mesh.groups import Group

ALGORITHMS = MappingProxyType({"ring": ring_attention, "all_to_all": all_to_all_attention,
                               "all_gather": all_gather_attention})
"""``parallel.cp_comm``: how attention spans the cp ranks."""


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Group,
           sequence: Sequence | None, algorithm: str = "ring", *,
           mask: torch.Tensor | None = None, dropout: float = 0.0) -> torch.Tensor:
    """q [b, heads, L, d] over k, v [b, kv_heads, L, d]: causal over the whole sequence (spread
    over ``cp`` by ``algorithm`` when cp > 1), within documents when ``sequence`` has them; an
    explicit ``mask`` (one process: a chunk after a cached prefix) replaces causality."""
    if cp.size > 1:
        return ALGORITHMS[algorithm](q, k, v, cp, sequence)
    if sequence is not None and sequence.documents is not None:
        index = sequence.global_index
        docs = sequence.documents
        mask = attention_mask(index, index, docs, docs)
    return attention_core(q, k, v, mask, dropout)
