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
    which is how a dataset is split into training and validation (:func:`train_valid_split`).
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


def valid_windows(total_tokens: int, seq_len: int, valid_fraction: float) -> int:
    """Validation windows of a dataset of ``total_tokens``: about ``valid_fraction`` of its
    tokens in whole windows, at least one, leaving training at least one (0: too small).

    Training then holds ``total_tokens - (k * seq_len + 1)`` tokens, which make at least one
    window if and only if ``k <= (total_tokens - 2) // seq_len - 1``.
    """
    most = (total_tokens - 2) // seq_len - 1
    if most < 1:
        return 0
    return min(most, max(1, round(valid_fraction * total_tokens / seq_len)))


def train_valid_split(
    indexed: IndexedDataset, seq_len: int, valid_fraction: float, name: str
) -> tuple[GPTDataset, GPTDataset]:
    """Training and validation windows of one dataset, split by tokens without a seed.

    Validation is the tail of the token stream (documents in order, cut inside a document
    when needed): :func:`valid_windows` whole windows, ``k * seq_len + 1`` tokens. Cutting
    tokens rather than choosing whole documents keeps the split at its share whatever the
    documents' sizes (a folder of two files no longer sends one to validation), and a tail
    matches Megatron's contiguous splits. Data too small for one window on each side
    (fewer than ``2 * (seq_len + 1)`` tokens) is refused.
    """
    total = indexed.total_tokens
    k = valid_windows(total, seq_len, valid_fraction)
    if k == 0:
        raise MeshtronError(
            f"{name} holds {total:,} tokens, too few for one training and one validation "
            f"window of train.seq_len+1 = {seq_len + 1} tokens each (at least "
            f"{2 * (seq_len + 1):,} tokens); lower train.seq_len or add text"
        )
    cut = total - (k * seq_len + 1)
    # Each side gets only the documents it overlaps, so neither holds run arrays of the other.
    ends = np.cumsum(indexed.sequence_lengths, dtype=np.int64)
    first_valid = int(np.searchsorted(ends, cut, side="right"))  # the document holding `cut`
    ids = np.arange(len(indexed), dtype=np.int64)
    head = int(ends[first_valid - 1]) if first_valid else 0  # tokens before that document
    train = GPTDataset(indexed, seq_len, ids[: first_valid + 1], (0, cut))
    valid = GPTDataset(indexed, seq_len, ids[first_valid:], (cut - head, total - head))
    return train, valid
