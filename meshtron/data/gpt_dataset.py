"""Fixed-length training windows over a stream of documents, and the train/validation split.

The stream is the chosen documents of an indexed dataset concatenated in the given order (each
ends with EOS, which tells the model where one document stops). Window i holds stream tokens
``[i*seq_len, i*seq_len + seq_len + 1)``: inputs and targets shifted by one, consecutive windows
sharing one token as in Megatron. The stream is never copied: documents that lie next to each
other in the ``.bin`` form one run, and a window is sliced from the one or few runs it spans,
found by binary search over cumulative run lengths.
"""

from __future__ import annotations

import numpy as np

from meshtron.data.indexed import IndexedDataset
from meshtron.errors import MeshtronError


class GPTDataset:
    """Windows of ``seq_len + 1`` tokens over documents ``document_ids`` of ``indexed``.

    ``token_range`` (start, stop) restricts the windows to part of the concatenated stream,
    which is how a dataset of a single document is split into training and validation.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        seq_len: int,
        document_ids: np.ndarray | None = None,
        token_range: tuple[int, int] | None = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.indexed = indexed
        self.seq_len = seq_len
        ids = np.arange(len(indexed)) if document_ids is None else np.asarray(document_ids)
        self.document_ids = ids.astype(np.int64)
        lengths = indexed.sequence_lengths[ids].astype(np.int64)
        starts = indexed.sequence_offsets[ids]
        # Merge documents stored back to back into runs that can be sliced in one piece.
        if len(ids):
            breaks = np.ones(len(ids), dtype=bool)
            breaks[1:] = starts[1:] != starts[:-1] + lengths[:-1]
            first = np.flatnonzero(breaks)
            self._run_starts = starts[first]
            self._run_lengths = np.add.reduceat(lengths, first)
        else:
            self._run_starts = self._run_lengths = np.zeros(0, dtype=np.int64)
        self._run_ends = np.cumsum(self._run_lengths)
        stream = int(self._run_ends[-1]) if len(ids) else 0
        lo, hi = (0, stream) if token_range is None else token_range
        if not 0 <= lo <= hi <= stream:
            raise ValueError(f"token_range {token_range} outside the stream of {stream} tokens")
        self._lo = lo
        self.num_tokens = hi - lo
        """Tokens in this dataset's part of the stream."""
        self._len = max(0, (self.num_tokens - 1) // seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> np.ndarray:
        """Window ``i`` as int64 ``[seq_len + 1]``."""
        if not 0 <= i < self._len:
            raise IndexError(f"window {i} out of range for {self._len} windows")
        size = self.seq_len + 1
        position = self._lo + i * self.seq_len
        run = int(np.searchsorted(self._run_ends, position, side="right"))
        out = np.empty(size, dtype=np.int64)
        filled = 0
        while filled < size:
            run_start = int(self._run_ends[run] - self._run_lengths[run])
            offset = position + filled - run_start
            take = min(int(self._run_lengths[run]) - offset, size - filled)
            begin = int(self._run_starts[run]) + offset
            out[filled : filled + take] = self.indexed.tokens[begin : begin + take]
            filled += take
            run += 1
        return out


def split_documents(num_docs: int, valid_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic, seed-free (train ids, valid ids) with validation documents spread evenly.

    With two or more documents each side gets at least one; with fewer, everything is training
    (split the tokens instead, see :func:`train_valid_split`).
    """
    everything = np.arange(num_docs, dtype=np.int64)
    if num_docs < 2:
        return everything, np.zeros(0, dtype=np.int64)
    count = min(num_docs - 1, max(1, round(num_docs * valid_fraction)))
    valid = ((np.arange(count) + 0.5) * (num_docs / count)).astype(np.int64)
    keep = np.ones(num_docs, dtype=bool)
    keep[valid] = False
    return everything[keep], valid


def train_valid_split(
    indexed: IndexedDataset, seq_len: int, valid_fraction: float, name: str
) -> tuple[GPTDataset, GPTDataset]:
    """Training and validation windows of one dataset.

    Whole documents go to validation (:func:`split_documents`) when both sides then hold at
    least one window. Otherwise (a single document, or one huge document among tiny ones) the
    token stream is cut instead: validation is its last ``valid_fraction`` of tokens.
    """
    if len(indexed) >= 2:
        train_ids, valid_ids = split_documents(len(indexed), valid_fraction)
        train = GPTDataset(indexed, seq_len, train_ids)
        valid = GPTDataset(indexed, seq_len, valid_ids)
        if len(train) and len(valid):
            return train, valid
    total = indexed.total_tokens
    cut = total - max(1, round(total * valid_fraction))
    train = GPTDataset(indexed, seq_len, None, (0, max(cut, 0)))
    valid = GPTDataset(indexed, seq_len, None, (max(cut, 0), total))
    for split, dataset in (("training", train), ("validation", valid)):
        if len(dataset) == 0:
            raise MeshtronError(
                f"the {split} split of {name} holds {dataset.num_tokens} tokens, fewer than "
                f"train.seq_len+1 = {seq_len + 1}; use a shorter seq_len or more text"
            )
    return train, valid
