"""The trainer's single entry point: from ``DataConfig`` to global batches of token windows.

Paths (or the embedded corpus) are resolved, a tokenizer is loaded, found beside a preprocessed
dataset or trained, each path is preprocessed into the cache and split by tokens into training
and validation windows (:func:`train_valid_split`), and the paths are blended by weight. Global
batch k is then a pure function of (seed, k): blend positions ``k*B .. k*B+B-1`` are assigned
to datasets by the blend rule, and each dataset walks its own windows in per-epoch shuffled
order (:class:`GlobalSampler`, one stream per dataset), so every dataset is covered fully
before any window repeats, whatever the weights.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from meshtron.config import Config, DataConfig
from meshtron.data.blend import BlendedDataset, parse_blend
from meshtron.data.corpus import stdlib_corpus
from meshtron.data.gpt_dataset import GPTDataset, train_valid_split
from meshtron.data.indexed import IndexedDataset, indexed_prefix
from meshtron.data.preprocessing import (
    TOKENIZER_SUFFIX,
    format_count,
    prepare_dataset,
    tokenizer_beside,
)
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

    def resolved(self, cfg: Config) -> Config:
        """``cfg`` as the data leaves it: text data resolves nothing of the model's."""
        return cfg


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
    tokenizer = _tokenizer(data_cfg, raw, preprocessed, cache_dir, log)

    names, trains, valids = [], [], []
    for item in inputs:
        name = item if isinstance(item, str) else item.name
        indexed = IndexedDataset(prepare_dataset(item, tokenizer, cache_dir, log))
        if isinstance(item, str):
            _check_vocab(indexed, tokenizer, name)
        if data_cfg.document_mask:
            _check_documents(indexed, tokenizer, name)
        train, valid = train_valid_split(indexed, seq_len, data_cfg.valid_fraction, name)
        if len(inputs) > 1:
            log(f"dataset {name}: {_split_summary([train], [valid])}")
        names.append(name)
        trains.append(train)
        valids.append(valid)
    data = TrainingData(
        tokenizer, BlendedDataset(trains, weights), BlendedDataset(valids, weights), seq_len, seed
    )
    blend = ""
    if len(inputs) > 1:
        shares = ", ".join(f"{n} {w:.3g}" for n, w in zip(names, data.train.weights, strict=True))
        blend = f"; blend weights {shares}"
    log(f"dataset: {_split_summary(trains, valids)}{blend}")
    return data


def _tokenizer(
    data_cfg: DataConfig, raw: list[TextSource], preprocessed: list[str], cache_dir: str, log: Log
) -> Tokenizer:
    """``data.tokenizer``, else the one beside the preprocessed datasets, else one trained on the
    raw text. Preprocessed datasets carrying different tokenizers cannot share one model."""
    beside = {path: tokenizer_beside(indexed_prefix(path) or path) for path in preprocessed}
    found = {path: tok for path, tok in beside.items() if tok.is_file()}
    if data_cfg.tokenizer:
        tokenizer = Tokenizer.load(data_cfg.tokenizer)
        log(f"tokenizer: {tokenizer.path} ({tokenizer.vocab_size} tokens)")
        for path, tok in found.items():
            if _sha256(tok) != tokenizer.fingerprint:
                log(f"warning: data.tokenizer {tokenizer.path} is not {tok}, the tokenizer "
                    f"{path} was preprocessed with")
        return tokenizer
    if not preprocessed:
        return train_tokenizer(raw, data_cfg.vocab_size, cache_dir, log)
    if not found:
        path = preprocessed[0]
        raise MeshtronError(
            f"data.path {path} is a preprocessed dataset without {beside[path].name} beside it; "
            "set data.tokenizer to the tokenizer.json it was made with "
            "(--data.tokenizer=PATH/tokenizer.json, or tokenizer: under data: in the config file)"
        )
    by_content: dict[str, str] = {}
    for path, tok in found.items():
        by_content.setdefault(_sha256(tok), path)
    if len(by_content) > 1:
        a, b = list(by_content.values())[:2]
        raise MeshtronError(
            f"data.path {a} and {b} were preprocessed with different tokenizers ({found[a]}, "
            f"{found[b]}); preprocess them with one (meshtron preprocess --tokenizer) or set "
            "data.tokenizer"
        )
    path, tok = next(iter(found.items()))
    tokenizer = Tokenizer.load(tok)
    log(f"tokenizer: {tokenizer.path} ({tokenizer.vocab_size} tokens), found beside {path}")
    for other in preprocessed:
        if other not in found:
            log(f"tokenizer: {other} has no {TOKENIZER_SUFFIX} beside it; assuming it was made "
                f"with {tokenizer.path}")
    return tokenizer


def _sha256(path: Path) -> str:
    """A tokenizer file's fingerprint, as :attr:`Tokenizer.fingerprint`, without parsing it."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as err:
        raise MeshtronError(f"cannot read tokenizer {path} ({err.strerror})") from None


def _split_summary(trains: list[GPTDataset], valids: list[GPTDataset]) -> str:
    """``2.1M tokens: 2.08M train (16,250 windows), 42.5K valid (331 windows)``."""
    train_tokens = sum(t.num_tokens for t in trains)
    valid_tokens = sum(v.num_tokens for v in valids)
    return (
        f"{format_count(train_tokens + valid_tokens)} tokens: {format_count(train_tokens)} train "
        f"({_windows(sum(len(t) for t in trains))}), {format_count(valid_tokens)} valid "
        f"({_windows(sum(len(v) for v in valids))})"
    )


def _windows(n: int) -> str:
    return f"{n:,} window" if n == 1 else f"{n:,} windows"


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
