"""``meshtron convert --from MODEL.gguf --to DIR``: a GGUF file as a meshtron checkpoint.

The file is turned into what the Hugging Face folder import works from, a ``config.json``
dict (:mod:`.gguf_config`), tensors under Hugging Face names (dequantised to fp32 by the
``gguf`` package, q/k rows put back in Hugging Face order) and a ``tokenizer.json``
(:mod:`.gguf_tokenizer`), and then written by :mod:`.hf_convert`'s own import, so the model's
config checks and tensor mapping are the HF import's. Every check (the metadata, each tensor's
presence, shape and type, the tokenizer) runs before anything is written: a refused file
leaves nothing at ``--to``. ``tokenizer_config.json`` (special tokens, chat template) is
written beside the checkpoint's ``tokenizer.json``; the special token ids and any sampling
settings the file records (``general.sampling.*``) become the checkpoint's ``generation``
section, read as the HF import reads a ``generation_config.json``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from meshtron.checkpoint.gguf_config import ARCHITECTURES, hf_config_from_gguf
from meshtron.checkpoint.gguf_file import GGUFModel
from meshtron.checkpoint.gguf_rope import NAME as ROPE_FACTORS
from meshtron.checkpoint.gguf_rope import llama3_from_factors
from meshtron.checkpoint.gguf_tensors import from_llama_cpp_order, gguf_names, qk_heads
from meshtron.checkpoint.gguf_tokenizer import tokenizer_config, tokenizer_from_gguf
from meshtron.checkpoint.hf_config import hf_model_config
from meshtron.checkpoint.hf_convert import (
    Conversion,
    expected_hf_shapes,
    import_config,
    write_import,
)
from meshtron.checkpoint.hf_generation import read_hf_generation
from meshtron.checkpoint.hf_mapping import from_hf
from meshtron.config import ModelConfig
from meshtron.data import Tokenizer
from meshtron.errors import MeshtronError
from meshtron.models.flops import padded_vocab_size

EXPLAINED_TENSORS = {
    ROPE_FACTORS: "per-frequency rope factors, which meshtron reads only for llama-block "
                  "models",
}
SAMPLING_KEYS = (("general.sampling.temp", "temperature"), ("general.sampling.top_k", "top_k"),
                 ("general.sampling.top_p", "top_p"))


def import_gguf(src: Path, dst: Path) -> Conversion:
    """Write the GGUF model ``src`` as a meshtron checkpoint under ``dst`` (a new or empty
    folder); returns what was written and notes for the user."""
    where = str(src)
    model = GGUFModel(src)
    meta = model.metadata
    if isinstance(meta.get("split.count"), int) and meta["split.count"] > 1:
        raise MeshtronError(f"{where} is part {meta.get('split.no', 0) + 1} of a GGUF split into "
                            f"{meta['split.count']} files; merge them first (llama.cpp's "
                            "gguf-split --merge)")
    hf = hf_config_from_gguf(meta, set(model.tensors), where)
    used = _rope_factors(model, hf)
    cfg = import_config(hf_model_config(hf, where), where)
    tensors = from_hf(_hf_tensors(model, hf["model_type"], hf, cfg.model, used), cfg.model)
    notes: list[str] = []
    tokenizer, why = tokenizer_from_gguf(meta, where)
    if tokenizer is None:
        notes.append(why)
    extra = {}
    if tokenizer is not None:
        config = tokenizer_config(meta, where, cfg.model.max_seq_len)
        extra["tokenizer_config.json"] = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    with tempfile.TemporaryDirectory() as tmp:  # empty: no generation_config.json is read
        cfg.generation, generation_notes = read_hf_generation(Path(tmp), _generation(meta))
        notes += generation_notes
        path = None
        if tokenizer is not None:
            path = Path(tmp) / "tokenizer.json"
            tokenizer.save(str(path))
            if not _usable_tokenizer(path, padded_vocab_size(cfg.model), where, notes):
                path = None
                extra.pop("tokenizer_config.json")
        return write_import(dst, cfg, tensors, path, notes, extra)


def _rope_factors(model: GGUFModel, hf: dict[str, Any]) -> set[str]:
    """Llama 3.1-style rope scaling from ``rope_freqs.weight`` into ``hf``'s rope_scaling;
    the tensor names read here."""
    if ROPE_FACTORS not in model.tensors or "head_dim" not in hf:
        return set()
    if hf.get("rope_scaling"):
        raise MeshtronError(f"{model.path}: both {ROPE_FACTORS} and rope.scaling.type scale "
                            "the rope; meshtron reads one")
    factors = model.tensor(ROPE_FACTORS)
    hf["rope_scaling"] = llama3_from_factors(factors, hf["head_dim"], hf["rope_theta"],
                                             hf["max_position_embeddings"], str(model.path))
    return {ROPE_FACTORS}


def _hf_tensors(model: GGUFModel, arch: str, hf: dict[str, Any], cfg: ModelConfig,
                used: set[str]) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face names, each checked (present, shape from the
    metadata, a type gguf can dequantise, no tensor left over) before any is dequantised."""
    where, spec = model.path, ARCHITECTURES[arch]
    expected = expected_hf_shapes(cfg)
    names = gguf_names(arch, cfg.num_layers, list(expected))
    for hf_name, name in names.items():
        if name not in model.tensors:
            raise MeshtronError(f"{where} lacks tensor '{name}', which its metadata implies")
        want = tuple(expected[hf_name])
        want = want[::-1] if hf_name.endswith(spec.transposed) else want
        if model.tensors[name].shape != want:
            raise MeshtronError(f"tensor '{name}' in {where} has shape "
                                f"{model.tensors[name].shape}, its metadata implies {want}")
    for name in sorted(set(model.tensors) - set(names.values()) - used):
        why = EXPLAINED_TENSORS.get(name, f"which a {arch} model of its metadata does not have")
        raise MeshtronError(f"{where} has tensor '{name}', {why}")
    model.check_types(list(names.values()))
    out = {}
    for hf_name, name in names.items():
        tensor = model.tensor(name)
        if hf_name.endswith(spec.transposed):
            tensor = tensor.t()
        if spec.permuted_qk:
            heads = qk_heads(hf_name, hf["num_attention_heads"], hf["num_key_value_heads"])
            tensor = tensor if heads is None else from_llama_cpp_order(tensor, heads)
        out[hf_name] = tensor.contiguous()
    return out


def _usable_tokenizer(path: Path, vocab: int, where: str, notes: list[str]) -> bool:
    """Whether the built tokenizer loads as meshtron's (which needs an end-of-text token it
    knows by name; if not, the model is imported without it, as the HF import does); one
    larger than the embedding is refused (the file contradicts itself)."""
    try:
        tokenizer = Tokenizer.load(path)
    except MeshtronError as err:
        notes.append(f"the tokenizer of {where} was not written, meshtron cannot use it: {err}")
        return False
    if tokenizer.vocab_size > vocab:
        raise MeshtronError(f"{where}: its tokenizer has {tokenizer.vocab_size} tokens, more "
                            f"than the {vocab} rows of token_embd.weight")
    return True


def _generation(meta: dict[str, Any]) -> dict[str, Any]:
    """The generation fields of the model's ``config.json``: the special token ids, and the
    sampling settings the file records (``general.sampling.*``); without those, generation is
    greedy, as transformers decodes a model that states nothing."""
    config: dict[str, Any] = {}
    for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        if isinstance(meta.get(f"tokenizer.ggml.{key}"), int):
            config[ours] = meta[f"tokenizer.ggml.{key}"]
    sampling = {ours: meta[key] for key, ours in SAMPLING_KEYS if key in meta}
    if sampling:
        config.update(do_sample=True, **sampling)
    return config
