"""Data: tokenizers, raw text sources, Megatron-format indexed datasets, windows, blends, sampling.

The trainer needs only :func:`build_training_data`; the other names are for tools and tests.
Those two load on first use (PEP 562): they import torch, and this package also holds commands
(``meshtron preprocess``, ``meshtron vla-data``) whose parsers ``meshtron --help`` builds.
"""

import typing

from meshtron.data.blend import BlendedDataset, parse_blend
from meshtron.data.corpus import stdlib_corpus
from meshtron.data.gpt_dataset import GPTDataset, train_valid_split, valid_windows
from meshtron.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    dtype_for_vocab,
    indexed_prefix,
)
from meshtron.data.preprocess import prepare_dataset, preprocess
from meshtron.data.sampler import GlobalSampler
from meshtron.data.sources import TextSource, open_source
from meshtron.data.tokenizer import EOS_TOKEN, Tokenizer, train_tokenizer

if typing.TYPE_CHECKING:
    from meshtron.data.training_data import TrainingData, build_training_data

__all__ = [
    "EOS_TOKEN",
    "BlendedDataset",
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
    """``TrainingData`` and ``build_training_data``, imported when first asked for."""
    if name in ("TrainingData", "build_training_data"):
        from meshtron.data import training_data

        return getattr(training_data, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
