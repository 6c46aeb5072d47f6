"""A Hugging Face model's generation config, in and out of meshtron's ``generation`` section.

On import the folder's ``generation_config.json`` is read; without one, the generation fields
of ``config.json`` (older models kept them there, and transformers still reads them). What the
file leaves out takes transformers' own defaults (``do_sample`` false, temperature 1.0, top-k
50, top-p 1.0), so ``meshtron generate`` decodes as ``model.generate()`` would: greedily for a
model that says nothing. Settings meshtron does not apply (a repetition penalty, beam search)
are named in a note, not silently dropped. On export the section is written back as
``generation_config.json``, with only the sampling fields a sampling config needs (transformers
refuses to save temperature/top-k/top-p beside ``do_sample: false``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshtron.config import GenerationConfig
from meshtron.config.generation_section import check_generation
from meshtron.errors import MeshtronError

SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p")
LENGTH_KEYS = ("max_new_tokens", "max_length")
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
HF_DEFAULTS: dict[str, Any] = {"do_sample": False, "temperature": 1.0, "top_k": 50,
                               "top_p": 1.0}
"""transformers' ``GenerationConfig`` defaults for what a file leaves out."""
NOT_APPLIED: dict[str, Any] = {"repetition_penalty": 1.0, "num_beams": 1, "min_p": None,
                               "typical_p": 1.0, "no_repeat_ngram_size": 0,
                               "min_new_tokens": None, "min_length": 0, "epsilon_cutoff": 0.0,
                               "eta_cutoff": 0.0}
"""Generation settings meshtron does not apply, at their neutral values."""


def read_hf_generation(folder: Path, hf_config: dict) -> tuple[GenerationConfig, list[str]]:
    """The generation section of the model in ``folder`` (whose config.json is
    ``hf_config``), and notes on settings left out."""
    path = folder / "generation_config.json"
    if path.is_file():
        data, source = read_json_object(path), "generation_config.json"
    else:
        data = {k: v for k, v in hf_config.items() if k in (*SAMPLING_KEYS, *LENGTH_KEYS,
                                                            *ID_KEYS, *NOT_APPLIED)}
        source = "config.json" if any(k in data for k in SAMPLING_KEYS) else "none"
        path = folder / "config.json"
    values = {k: data.get(k) if data.get(k) is not None else HF_DEFAULTS[k]
              for k in SAMPLING_KEYS}
    gen = GenerationConfig(
        do_sample=_typed(path, "do_sample", values["do_sample"], bool),
        temperature=float(_typed(path, "temperature", values["temperature"], (int, float))),
        top_k=_typed(path, "top_k", values["top_k"], int),
        top_p=float(_typed(path, "top_p", values["top_p"], (int, float))),
        max_new_tokens=_optional_int(path, data, "max_new_tokens"),
        max_length=_optional_int(path, data, "max_length"),
        bos_token_id=_optional_int(path, data, "bos_token_id"),
        eos_token_id=_eos_ids(path, data.get("eos_token_id")),
        pad_token_id=_optional_int(path, data, "pad_token_id"),
        source=source)
    _check_ranges(path, gen)
    notes = [f"{path.name} sets {key}={json.dumps(data[key])}, which meshtron's generation does "
             "not apply (left out)" for key, neutral in NOT_APPLIED.items()
             if data.get(key, neutral) not in (neutral, None)]
    return gen, notes


def silent_generation() -> GenerationConfig:
    """The section of an imported model that states no generation settings: transformers'
    defaults, so greedy decoding."""
    return GenerationConfig(**HF_DEFAULTS, source="none")


def hf_generation_dict(gen: GenerationConfig, eos_id: int | None) -> dict[str, Any]:
    """``generation_config.json`` for ``gen``; ``eos_id`` (the tokenizer's) when the section
    names no end-of-sequence id."""
    out: dict[str, Any] = {"do_sample": gen.do_sample and not gen.greedy}
    if out["do_sample"]:
        out.update(temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p)
    for key in LENGTH_KEYS + ("bos_token_id", "pad_token_id"):
        if getattr(gen, key) is not None:
            out[key] = getattr(gen, key)
    eos = gen.eos_token_id if gen.eos_token_id is not None else (
        [eos_id] if eos_id is not None else None)
    if eos is not None:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out


def read_json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MeshtronError(f"{path} cannot be read as JSON ({err})") from None
    except RecursionError:
        raise MeshtronError(f"{path} is nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise MeshtronError(f"{path} does not hold a JSON object")
    return data


def _typed(path: Path, key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    wrong_bool = isinstance(value, bool) and kind is not bool
    if wrong_bool or not isinstance(value, kind):
        raise MeshtronError(f"{path}: {key} must be a "
                            f"{'boolean' if kind is bool else 'number'}, got {json.dumps(value)}")
    return value


def _optional_int(path: Path, data: dict, key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MeshtronError(f"{path}: {key} must be a whole number >= 0, got {json.dumps(value)}")
    return value


def _eos_ids(path: Path, value: Any) -> list[int] | None:
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise MeshtronError(f"{path}: eos_token_id must be a token id or a list of them, got "
                            f"{json.dumps(value)}")
    return ids


def _check_ranges(path: Path, gen: GenerationConfig) -> None:
    """The section's own checks, the file named."""
    try:
        check_generation(gen)
    except MeshtronError as err:
        raise MeshtronError(f"{path}: {err}") from None


