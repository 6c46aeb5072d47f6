"""Hugging Face ``config.json`` to and from meshtron's :class:`ModelConfig`.

Which family a file belongs to comes from its ``model_type`` (or, in older files, its
``architectures`` class name), looked up in the architecture registry; every class that
``architectures`` names must be one of that family's. The family's field table and checks
(see :mod:`meshtron.models.arch`) do the rest. Nothing here imports
``transformers``: its config files are read and written as JSON.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from meshtron.checkpoint.hf_mapping import hf_config_kwargs, hf_format
from meshtron.config import ModelConfig
from meshtron.errors import MeshtronError
from meshtron.models.arch import REFUSED_HF_TYPES, hf_model_types
from meshtron.models.architecture import HFConfig, HFFormat

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def supported_families() -> str:
    """'GPT-2, Llama, ... and Qwen3-MoE': the families meshtron converts, for messages."""
    names = sorted(t.display for _, t in hf_model_types().values())
    return f"{', '.join(names[:-1])} and {names[-1]}"


def _architectures(hf: dict[str, Any], where: str) -> list[str]:
    """The class names config.json's ``architectures`` lists (none when it has no list)."""
    names = hf.get("architectures")
    if names is None:
        return []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise MeshtronError(f"{where}: 'architectures' must be a list of class names, "
                            f"got {str(names)[:80]}")
    return names


def family_classes(fmt: HFFormat) -> set[str]:
    """The ``transformers`` classes a family's folders are saved from: each model type's
    causal-LM class and its base model (``LlamaModel``: no LM head, read as tied)."""
    classes = set()
    for t in fmt.model_types:
        stem = t.class_name.removesuffix("ForCausalLM").removesuffix("LMHeadModel")
        classes |= {t.class_name, f"{stem}Model"}
    return classes


def _model_type(hf: dict[str, Any], where: str) -> str:
    known = hf_model_types()
    architectures = _architectures(hf, where)
    model_type = hf.get("model_type")
    if model_type is None:  # older files name only the class
        by_class = {t.class_name: name for name, (_, t) in known.items()}
        model_type = next((by_class[a] for a in architectures if a in by_class), None)
    if not isinstance(model_type, str) or model_type not in known:
        found = str(model_type or "/".join(architectures) or "unknown")[:80]
        why = f" ({REFUSED_HF_TYPES[found]})" if found in REFUSED_HF_TYPES else ""
        raise MeshtronError(f"{where}: unsupported architecture '{found}'{why}; meshtron "
                            f"converts {supported_families()}")
    fmt, hf_type = known[model_type]
    classes = family_classes(fmt)
    for name in architectures:
        if name not in classes:
            raise MeshtronError(
                f"{where}: architectures names {name[:80]}, which is not a {hf_type.display} "
                f"class (model_type '{model_type}' reads as {', '.join(sorted(classes))})")
    return model_type


def hf_model_config(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """A meshtron ``ModelConfig`` from an HF ``config.json`` dict, refusing by name what
    meshtron's blocks cannot compute exactly (other rope types, partial rotary, other
    activations, sliding windows on some layers only, expert patterns it cannot say)."""
    fmt, model_type = hf_model_types()[_model_type(hf, where)]
    reader = HFConfig(hf, model_type.defaults, where)
    values = {ours: reader.get(theirs) for ours, theirs in fmt.fields}
    fmt.from_config(reader, values)
    cfg = ModelConfig(**values)
    cfg.vocab_size, cfg.vocab_multiple = _vocab(reader.saved(), reader.get("vocab_size"))
    return cfg


def _vocab(saved: dict[str, Any], vocab: int) -> tuple[int, int]:
    """(vocab_size, vocab_multiple) whose padded size is exactly ``vocab``: the values meshtron
    exported when they fit, else the largest power of two up to 128 that divides ``vocab``
    (tensor parallelism needs tp to divide the padded size, here ``vocab`` itself)."""
    size, multiple = saved.get("vocab_size"), saved.get("vocab_multiple")
    if (isinstance(size, int) and isinstance(multiple, int) and 0 < size <= vocab
            and multiple > 0 and math.ceil(size / multiple) * multiple == vocab):
        return size, multiple
    return vocab, math.gcd(vocab, 128)


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype, eos_id: int | None) -> dict[str, Any]:
    """The ``config.json`` of the HF twin of ``cfg``."""
    fmt = hf_format(cfg)
    model_type = fmt.model_types[0]
    saved = {"vocab_size": cfg.vocab_size, "vocab_multiple": cfg.vocab_multiple,
             **fmt.saved(cfg)}
    return {
        "architectures": [model_type.class_name], "model_type": model_type.name,
        **hf_config_kwargs(cfg),
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": None,
        "torch_dtype": DTYPE_NAMES.get(dtype, "float32"), "meshtron": saved,
    }
