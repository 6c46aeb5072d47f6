"""Data: tokenizers, raw text sources, Megatron-format indexed datasets, windows, blends, sampling.

The trainer needs only :func:`build_training_data`; the other names are for tools and tests.
They load on first use (PEP 562): this package also holds commands (``meshtron preprocess``,
``meshtron vla-data``, ``meshtron sample-data``) whose parsers ``meshtron --help`` builds, and
importing any module here runs this file first, which must not pull in numpy, tokenizers and
torch for that. (The module behind :func:`preprocess` is ``preprocessing``: a submodule named
like a name exported here would replace it on the package once imported.)
"""

from __future__ import annotations

import importlib
import typing

if typing.TYPE_CHECKING:
    from meshtron.data.blend import BlendedDataset, parse_blend
    from meshtron.data.corpus import stdlib_corpus
    from meshtron.data.gpt_dataset import GPTDataset, train_valid_split, valid_windows
    from meshtron.data.indexed import (
        IndexedDataset,
        IndexedDatasetWriter,
        dtype_for_vocab,
        indexed_prefix,
    )
    from meshtron.data.preprocessing import prepare_dataset, preprocess
    from meshtron.data.sampler import GlobalSampler
    from meshtron.data.sources import TextSource, open_source
    from meshtron.data.tokenizer import EOS_TOKEN, Tokenizer, train_tokenizer
    from meshtron.data.training_data import TrainingData, build_training_data

_HOMES = {
    "BlendedDataset": "blend", "parse_blend": "blend",
    "stdlib_corpus": "corpus",
    "GPTDataset": "gpt_dataset", "train_valid_split": "gpt_dataset",
    "valid_windows": "gpt_dataset",
    "IndexedDataset": "indexed", "IndexedDatasetWriter": "indexed",
    "dtype_for_vocab": "indexed", "indexed_prefix": "indexed",
    "prepare_dataset": "preprocessing", "preprocess": "preprocessing",
    "GlobalSampler": "sampler",
    "TextSource": "sources", "open_source": "sources",
    "EOS_TOKEN": "tokenizer", "Tokenizer": "tokenizer", "train_tokenizer": "tokenizer",
    "TrainingData": "training_data", "build_training_data": "training_data",
}
"""Each public name and the module of this package that defines it."""

__all__ = [
    "BlendedDataset",
    "EOS_TOKEN",
    "GPTDataset",
    "GlobalSampler",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "TextSource",
    "Tokenizer",
    "TrainingData",
    "build_training_data",
    "dtype_for_vocab",
    "indexed_prefix",
    "open_source",
    "parse_blend",
    "prepare_dataset",
    "preprocess",
    "stdlib_corpus",
    "train_tokenizer",
    "train_valid_split",
    "valid_windows",
]


def __getattr__(name: str) -> typing.Any:
    """``meshtron.data.NAME``: imported from its module when first asked for."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
