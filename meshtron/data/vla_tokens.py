"""The tokens of a vision-language-action policy: instruction words and discretised actions.

The vocabulary is a word-level ``tokenizer.json`` (Hugging Face ``tokenizers``, so a checkpoint
carries it as it carries a text model's): a pad token, the end-of-text token, the task's
instruction words, then ``bins`` action tokens ``<a000>``.. shared by every action dimension
(OpenVLA's scheme: each dimension's range is cut into equal bins, a value becomes the token of
its bin and a token the centre of its bin).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshtron.data.cache import atomic_write_bytes, content_key, entry_dir
from meshtron.data.tokenizer import EOS_TOKEN, Tokenizer
from meshtron.errors import MeshtronError

PAD_TOKEN = "<pad>"
ACTION_TOKEN = "<a{:03d}>"


def vla_tokenizer(words: Sequence[str], bins: int, cache_dir: str | Path) -> Tokenizer:
    """The word-level tokenizer of ``words`` and ``bins`` action tokens, written once into the
    cache (its content names it) and loaded from there."""
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1}
    for word in words:
        vocab.setdefault(word, len(vocab))
    for b in range(bins):
        vocab[ACTION_TOKEN.format(b)] = len(vocab)
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for t, i in vocab.items() if t in (PAD_TOKEN, EOS_TOKEN)],
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": PAD_TOKEN},
    }
    data = json.dumps(spec, indent=1).encode()
    path = entry_dir(cache_dir, "vla-tokenizer", content_key(data.decode())) / "tokenizer.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
    return Tokenizer.load(path)


@dataclass(frozen=True)
class ActionCodec:
    """Continuous actions <-> action tokens, per dimension over [low, high] in ``bins`` bins."""

    low: tuple[float, ...]
    high: tuple[float, ...]
    bins: int
    first_id: int
    """The id of ``<a000>``."""

    @classmethod
    def of(cls, tokenizer: Tokenizer, low: Sequence[float], high: Sequence[float],
           bins: int) -> ActionCodec:
        first = tokenizer.token_id(ACTION_TOKEN.format(0))
        last = tokenizer.token_id(ACTION_TOKEN.format(bins - 1))
        if first is None or last != first + bins - 1:
            raise MeshtronError(f"{tokenizer.path} has no {bins} action tokens "
                                f"({ACTION_TOKEN.format(0)}..); it is not a vision-language-"
                                "action policy's tokenizer")
        return cls(tuple(map(float, low)), tuple(map(float, high)), bins, first)

    def encode(self, actions: np.ndarray) -> np.ndarray:
        """Actions [..., dims] -> token ids [..., dims] (values outside the range clip)."""
        low, high = np.asarray(self.low), np.asarray(self.high)
        unit = (np.asarray(actions, dtype=np.float64) - low) / (high - low)
        index = np.clip(np.floor(unit * self.bins), 0, self.bins - 1).astype(np.int64)
        return index + self.first_id

    def decode(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [..., dims] -> the centres of their bins, float32 [..., dims]."""
        low, high = np.asarray(self.low), np.asarray(self.high)
        index = np.clip(np.asarray(ids) - self.first_id, 0, self.bins - 1)
        return (low + (index + 0.5) * (high - low) / self.bins).astype(np.float32)
