"""The trainer's single entry point: from ``DataConfig`` to global batches of token windows.

Paths (or the embedded corpus) are resolved, a tokenizer is loaded or trained, each path is
preprocessed into the cache, split into training and validation windows, and the paths are
blended by weight. Global batch k is then a pure function of (seed, k): blend positions
``k*B .. k*B+B-1`` are assigned to datasets by the blend rule, and each dataset walks its own
windows in per-epoch shuffled order (:class:`GlobalSampler`, one stream per dataset), so every
dataset is covered fully before any window repeats, whatever the weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from meshtron.config import DataConfig
from meshtron.data.blend import BlendedDataset, parse_blend
from meshtron.data.corpus import stdlib_corpus
from meshtron.data.gpt_dataset import train_valid_split
from meshtron.data.indexed import IndexedDataset, indexed_prefix
from meshtron.data.preprocess import prepare_dataset
from meshtron.data.sampler import GlobalSampler
from meshtron.data.sources import TextSource, open_source
from meshtron.data.tokenizer import Log, Tokenizer, train_tokenizer
from meshtron.errors import MeshtronError

_VOCAB_CHECK_TOKENS = 1 << 26


@dataclass
class TrainingData:
    """Tokenizer plus training and validation windows, served as whole global batches."""

    tokenizer: Tokenizer
    train: BlendedDataset
    valid: BlendedDataset
    seq_len: int
    seed: int
    _samplers: dict[int, list[GlobalSampler]] = field(default_factory=dict, repr=False)

    def train_batch(self, k: int, global_batch: int) -> torch.Tensor:
        """Global batch ``k``, int64 [global_batch, seq_len+1], a function of (seed, k) only."""
        if global_batch not in self._samplers:
            self._samplers[global_batch] = [
                GlobalSampler(len(dataset), global_batch, self.seed, stream=d)
                for d, dataset in enumerate(self.train.datasets)
            ]
        samplers = self._samplers[global_batch]
        positions = np.arange(k * global_batch, (k + 1) * global_batch, dtype=np.int64)
        datasets, picks = self.train.locate(positions)
        out = np.empty((global_batch, self.seq_len + 1), dtype=np.int64)
        for d in np.unique(datasets):
            rows = np.flatnonzero(datasets == d)
            windows = samplers[d].indices(picks[rows])
            for row, window in zip(rows, windows, strict=True):
                out[row] = self.train.datasets[d][int(window)]
        return torch.from_numpy(out)

    def valid_batch(self, k: int, batch: int) -> torch.Tensor:
        """Validation batch ``k``: windows in fixed order, wrapping around at the end."""
        start = k * batch
        positions = np.arange(start, start + batch, dtype=np.int64) % len(self.valid)
        datasets, picks = self.valid.locate(positions)
        out = np.empty((batch, self.seq_len + 1), dtype=np.int64)
        for row, (d, j) in enumerate(zip(datasets, picks, strict=True)):
            dataset = self.valid.datasets[d]
            out[row] = dataset[int(j) % len(dataset)]
        return torch.from_numpy(out)


def build_training_data(
    data_cfg: DataConfig, seq_len: int, seed: int, log: Log = print
) -> TrainingData:
    """Everything the trainer needs from ``data.*``; raw text is preprocessed once and cached."""
    cache_dir = os.path.expanduser(data_cfg.cache_dir)
    if data_cfg.path:
        entries = parse_blend(data_cfg.path)
        weights = [weight for weight, _ in entries]
        inputs: list[str | TextSource] = [
            path if indexed_prefix(path) is not None else open_source(path) for _, path in entries
        ]
    else:
        weights = [1.0]
        inputs = [stdlib_corpus(int(data_cfg.corpus_max_mb * 1e6))]
    raw = [x for x in inputs if isinstance(x, TextSource)]
    preprocessed = [x for x in inputs if isinstance(x, str)]

    if data_cfg.tokenizer:
        tokenizer = Tokenizer.load(data_cfg.tokenizer)
        log(f"tokenizer: {tokenizer.path} ({tokenizer.vocab_size} tokens)")
    elif preprocessed:
        raise MeshtronError(
            f"data.path {preprocessed[0]} is an already preprocessed dataset; set data.tokenizer "
            "to the tokenizer.json it was made with"
        )
    else:
        tokenizer = train_tokenizer(raw, data_cfg.vocab_size, cache_dir, log)

    trains, valids = [], []
    for item in inputs:
        name = item if isinstance(item, str) else item.name
        indexed = IndexedDataset(prepare_dataset(item, tokenizer, cache_dir, log))
        if isinstance(item, str):
            _check_vocab(indexed, tokenizer, name)
        if data_cfg.document_mask:
            _check_documents(indexed, tokenizer, name)
        train, valid = train_valid_split(indexed, seq_len, data_cfg.valid_fraction, name)
        if len(inputs) > 1:
            log(f"dataset: {name}: {_count(indexed.total_tokens)} tokens, {len(train)} train "
                f"windows, {len(valid)} valid windows")
        trains.append(train)
        valids.append(valid)
    data = TrainingData(
        tokenizer, BlendedDataset(trains, weights), BlendedDataset(valids, weights), seq_len, seed
    )
    tokens = sum(t.num_tokens + v.num_tokens for t, v in zip(trains, valids, strict=True))
    log(f"dataset: {_count(tokens)} tokens, {len(data.train)} train windows, "
        f"{len(data.valid)} valid windows")
    return data


def _check_vocab(indexed: IndexedDataset, tokenizer: Tokenizer, name: str) -> None:
    """Catch a dataset made with another tokenizer (checks its first 64M tokens)."""
    head = indexed.tokens[:_VOCAB_CHECK_TOKENS]
    if len(head) and int(head.max()) >= tokenizer.vocab_size:
        raise MeshtronError(
            f"{name} holds token id {int(head.max())}, beyond the {tokenizer.vocab_size} tokens "
            f"of {tokenizer.path}; set data.tokenizer to the tokenizer it was made with"
        )


def _check_documents(indexed: IndexedDataset, tokenizer: Tokenizer, name: str) -> None:
    """Document masks need documents: EOS tokens in the data (checks its first 64M tokens, and
    is satisfied by a one-document dataset that ends with EOS)."""
    head = indexed.tokens[:_VOCAB_CHECK_TOKENS]
    if len(head) and not (head == tokenizer.eos_id).any():
        raise MeshtronError(
            f"data.document_mask=true, but {name} holds no EOS token (id {tokenizer.eos_id}), so "
            "its documents cannot be told apart; preprocess it with meshtron (documents end with "
            "EOS) or set data.document_mask=false"
        )


def _count(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 1_000:
        return f"{n / 1e3:.1f}K"
    return str(n)
