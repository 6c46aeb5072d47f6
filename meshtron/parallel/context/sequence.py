"""Where a rank's tokens sit in their sequences: the load-balanced context-parallel split,
positions, and the documents of packed sequences.

Under context parallelism every sequence of S tokens is cut into 2·cp chunks of S / (2·cp);
cp rank i holds chunks i and 2·cp − 1 − i, in that order. With causal attention a chunk's work
grows with its index, so pairing the i-th cheapest with the i-th most expensive gives every
rank the same work::

    cp = 2, S = 8:   chunks  [0 1 | 2 3 | 4 5 | 6 7]    rank 0: chunks 0 and 3
                              c0    c1    c2    c3       rank 1: chunks 1 and 2

Inputs, targets and positions follow the same chunks, so a rank's loss is the token-loss sum
of its own positions and the global mean needs only the dp × cp sum the gradients already get.

A packed sequence holds several documents, each ending with EOS. With ``data.document_mask``
a token attends only to earlier tokens of its own document (``documents`` numbers them over the
whole sequence, so every cp rank can mask any pair of chunks); ``data.reset_positions``
restarts positions at every document.

Tokens stored as -(id + 1) are read but never predicted (their target is -1, which the loss
skips): a conversation's prompt (:mod:`meshtron.data.chat`), a policy's observation. Batch rows
may carry more than a token window (a :class:`RowFormat` unpacks them): the model's other
inputs by name, handed to it untouched. What those inputs are is the data's and the model's
business, not the split's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from meshtron.parallel.mesh.groups import Group


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices cp rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def split_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of ``x`` along ``dim`` (the whole of ``x`` when cp is 1)."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in rank_chunks(rank, cp)], dim=dim)


def join_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`split_sequence`: every rank's part (in rank order) -> the sequence."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        a, b = rank_chunks(rank, cp)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Sequence:
    """What attention and position embeddings need to know of a rank's tokens."""

    positions: torch.Tensor
    """Position of each local token, [b, L] (global positions, or within-document ones)."""
    global_index: torch.Tensor
    """Index in the whole sequence of each local token, [L]: what causality compares."""
    documents: torch.Tensor | None
    """Document number of every position of the whole sequence, [b, S]; None: no masking."""

    def local_documents(self) -> torch.Tensor | None:
        return None if self.documents is None else self.documents[:, self.global_index]


def attention_mask(q_index: torch.Tensor, k_index: torch.Tensor,
                   q_docs: torch.Tensor | None, k_docs: torch.Tensor | None) -> torch.Tensor:
    """True where a query may attend to a key: the key is not later in the sequence, and (with
    documents, [b, Lq] and [b, Lk]) both are in the same document. Shape [b or 1, 1, Lq, Lk]."""
    allowed = (k_index[None, :] <= q_index[:, None])[None, None]
    if q_docs is not None:
        allowed = allowed & (q_docs[:, None, :, None] == k_docs[:, None, None, :])
    return allowed


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The document of each position of ``tokens`` [b, S]: the number of EOS tokens strictly
    before it (an EOS belongs to the document it ends)."""
    ends = (tokens == eos_id).long()
    return torch.cumsum(ends, dim=1) - ends


def positions_in_documents(documents: torch.Tensor) -> torch.Tensor:
    """Each position's index within its document, [b, S]."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return index - first


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as this rank's model sees it: its tokens, their targets and, when the
    sequence is split over cp or masked by document, where they sit."""

    tokens: torch.Tensor
    targets: torch.Tensor
    sequence: Sequence | None = None
    ahead: torch.Tensor | None = None
    """Multi-token prediction's inputs and targets, [depth + 1, b, L]: ``ahead[j]`` holds the
    token 1 + j positions after each local one (``ahead[0]`` the targets), -1 past the end of
    the window; None without multi-token prediction."""
    inputs: Mapping[str, torch.Tensor] | None = None
    """The model's inputs besides token ids, by name (``Transformer.forward(inputs=)``),
    one row per sequence; None: tokens only."""


class RowFormat(Protocol):
    """How a batch row carries more than a token window (the data of a model that reads
    other inputs packs its rows so; rows then split over dp and micro-batches as windows do)."""

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rows [b, ...] -> their windows [b, S + 1], with tokens that are read but never
        predicted stored as -(id + 1), and the model's other inputs by name."""
        ...


class SequenceSplit:
    """Turns token windows [b, S + 1] into this rank's :class:`MicroBatch`. With cp = 1 and no
    document mask it only shifts (``sequence`` None: the model's plain causal path)."""

    def __init__(self, cp: Group, document_mask: bool = False, reset_positions: bool = False,
                 eos_id: int | None = None, mtp_depth: int = 0,
                 rows: RowFormat | None = None):
        if (document_mask or reset_positions) and eos_id is None:
            raise ValueError("document masks need the tokenizer's EOS id")
        self.cp = cp
        self.mtp_depth = mtp_depth
        self.document_mask = document_mask
        self.reset_positions = reset_positions
        self.eos_id = eos_id
        self.rows = rows
        """Rows that carry other inputs beside the window (None: rows are windows)."""

    @property
    def plain(self) -> bool:
        return self.cp.size == 1 and not self.document_mask and not self.reset_positions

    def __call__(self, window: torch.Tensor) -> MicroBatch:
        if self.rows is not None:
            return self._unpacked(window)
        # tokens stored as -(id + 1) (conversations' prompts) are read, never predicted
        tokens = torch.where(window < 0, -window - 1, window)[:, :-1]
        targets = window[:, 1:].clamp(min=-1)
        rank, cp, seq = self.cp.rank, self.cp.size, tokens.shape[1]
        ahead = None
        if self.mtp_depth:
            padded = F.pad(window, (0, self.mtp_depth), value=-1)
            ahead = split_sequence(torch.stack([padded[:, 1 + j:1 + j + seq]
                                                for j in range(self.mtp_depth + 1)]),
                                   rank, cp, dim=2)
        if self.plain:
            return MicroBatch(tokens, targets, ahead=ahead)
        index = split_sequence(torch.arange(seq, device=tokens.device), rank, cp, dim=0)
        documents = None
        positions = index.expand(tokens.shape[0], -1)
        if self.document_mask or self.reset_positions:
            docs = document_ids(tokens, self.eos_id)
            documents = docs if self.document_mask else None
            if self.reset_positions:
                positions = positions_in_documents(docs)[:, index]
        return MicroBatch(split_sequence(tokens, rank, cp), split_sequence(targets, rank, cp),
                          Sequence(positions, index, documents), ahead)

    def _unpacked(self, rows: torch.Tensor) -> MicroBatch:
        """Packed rows -> tokens, targets (-1 where only read) and the other inputs; the plan
        refuses cp, document masks and multi-token prediction for such models."""
        window, inputs = self.rows.unpack(rows)
        tokens = torch.where(window < 0, -window - 1, window)[:, :-1]
        targets = window[:, 1:].clamp(min=-1)
        return MicroBatch(tokens, targets, inputs=inputs)
