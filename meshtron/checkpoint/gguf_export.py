"""``meshtron convert --from RUN --to OUT.gguf --format gguf``: a checkpoint as a GGUF file.

The model goes out as the Hugging Face export would write it (:mod:`.hf_convert`,
:mod:`.hf_mapping`: its config.json dict and HF-named tensors), then into llama.cpp's names,
metadata and q/k row order (:mod:`.gguf_config`, :mod:`.gguf_tensors`) and through
``gguf.GGUFWriter``. Matrices are written as F32 (default), F16, BF16 or Q8_0
(``--gguf-type``; a Q8_0 matrix whose rows are not whole 32-value blocks is written as F16, as
llama.cpp's converter does); vectors (norms, biases) stay F32, as llama.cpp keeps them. The
tokenizer goes in when it is a byte-level BPE (:mod:`.gguf_tokenizer`), with the BOS/EOS
tokens and chat template of a ``tokenizer_config.json`` kept beside the checkpoint by an
import. The file is written under a temporary name and renamed: a failed export leaves
nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from meshtron.checkpoint.gguf_config import ARCHITECTURES, gguf_metadata
from meshtron.checkpoint.gguf_rope import NAME as ROPE_FACTORS
from meshtron.checkpoint.gguf_rope import rope_factors
from meshtron.checkpoint.gguf_tensors import gguf_names, qk_heads, to_llama_cpp_order
from meshtron.checkpoint.gguf_tokenizer import gguf_tokenizer_metadata
from meshtron.checkpoint.hf_config import hf_config_dict
from meshtron.checkpoint.hf_convert import Conversion, read_export_state
from meshtron.checkpoint.hf_mapping import hf_format, to_hf
from meshtron.config import GenerationConfig
from meshtron.data import Tokenizer
from meshtron.errors import MeshtronError

Q = gguf.GGMLQuantizationType
GGUF_TYPES = {"f32": (Q.F32, gguf.LlamaFileType.ALL_F32),
              "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
              "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16),
              "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}
"""``--gguf-type`` -> (the type of the matrices, the file type recorded in the metadata)."""
INT32_KEYS = ("general.sampling.top_k",)
"""Integer keys llama.cpp reads as int32 (the others as uint32)."""


def export_gguf(checkpoint: Path, dst: Path, gguf_type: str = "f32") -> Conversion:
    """Write the meshtron checkpoint ``checkpoint`` as the GGUF file ``dst``."""
    if gguf_type not in GGUF_TYPES:
        raise MeshtronError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, "
                            f"got '{gguf_type}'")
    cfg, state, tokenizer_path = read_export_state(checkpoint)
    model_cfg = cfg.model
    tokenizer = Tokenizer.load(tokenizer_path) if tokenizer_path is not None else None
    hf = hf_config_dict(model_cfg, torch.float32, tokenizer.eos_id if tokenizer else None)
    arch, meta = gguf_metadata(hf)
    tensors = to_hf(state, model_cfg)
    if model_cfg.tie_embeddings:  # llama.cpp reads a missing output.weight as tied
        del tensors[hf_format(model_cfg).head]
    notes: list[str] = []
    meta.update(_tokenizer_metadata(checkpoint, tokenizer, hf["vocab_size"], notes))
    meta.update(_generation_metadata(cfg.generation, meta))
    qtype, file_type = GGUF_TYPES[gguf_type]
    meta["general.file_type"] = int(file_type)
    names = gguf_names(arch, model_cfg.num_layers, list(tensors))
    encoded = {}
    spec = ARCHITECTURES[arch]
    for hf_name, tensor in tensors.items():
        if hf_name.endswith(spec.transposed):  # GPT-2's Conv1D [in, out] -> [out, in]
            tensor = tensor.t()
        if spec.permuted_qk:
            heads = qk_heads(hf_name, hf["num_attention_heads"], hf["num_key_value_heads"])
            tensor = tensor if heads is None else to_llama_cpp_order(tensor, heads)
        encoded[names[hf_name]] = _encode(tensor, qtype)
    if model_cfg.rope.scaling == "llama3":  # llama.cpp's form: one factor per frequency
        factors = rope_factors(model_cfg.head_size, model_cfg.rope_theta, model_cfg.rope,
                               model_cfg.max_seq_len)
        encoded[ROPE_FACTORS] = (Q.F32, factors.numpy())
    fallback = sum(t == Q.F16 for t, _ in encoded.values() if qtype == Q.Q8_0)
    if fallback:
        notes.append(f"{fallback} matrices whose rows are not whole Q8_0 blocks of 32 were "
                     "written as F16")
    _write(dst, arch, meta, encoded)
    return Conversion(dst, tuple(notes))


def _encode(tensor: torch.Tensor, qtype: Q) -> tuple[Q, np.ndarray]:
    """(type, data) of one tensor: vectors F32, matrices as ``qtype`` (F16 for Q8_0 when a row
    is not whole blocks)."""
    values = tensor.detach().to(torch.float32).contiguous().numpy()
    if values.ndim < 2 or qtype == Q.F32:
        return Q.F32, values
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if values.shape[-1] % block:
        qtype = Q.F16
    return qtype, gguf.quants.quantize(values, qtype)


def _tokenizer_metadata(checkpoint: Path, tokenizer: Tokenizer | None, vocab: int,
                        notes: list[str]) -> dict[str, Any]:
    """``tokenizer.*`` metadata: the vocabulary, BOS/EOS ids and chat template."""
    if tokenizer is None:
        notes.append(f"checkpoint {checkpoint} has no tokenizer.json, so the GGUF file has no "
                     "tokenizer (llama.cpp needs one; transformers reads the model without)")
        return {}
    meta, why = gguf_tokenizer_metadata(tokenizer.path.read_text(), vocab)
    if meta is None:
        notes.append(f"tokenizer not written to the GGUF file: {why}")
        return {}
    config = _tokenizer_config(checkpoint)
    eos = tokenizer.token_id(config.get("eos_token") or "")
    meta["tokenizer.ggml.eos_token_id"] = tokenizer.eos_id if eos is None else eos
    bos = tokenizer.token_id(config.get("bos_token") or "")
    if bos is not None:
        meta["tokenizer.ggml.bos_token_id"] = bos
    sentencepiece = meta["tokenizer.ggml.model"] == "llama"  # llama.cpp's default: BOS there
    meta["tokenizer.ggml.add_bos_token"] = bool(config.get("add_bos_token", sentencepiece))
    if isinstance(config.get("chat_template"), str):
        meta["tokenizer.chat_template"] = config["chat_template"]
    return meta


def _generation_metadata(gen: GenerationConfig, meta: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's generation section as GGUF says it: its BOS/EOS ids (they name the
    model's own, e.g. an instruct model's end of turn, over the tokenizer's document
    separator) and, when it samples, ``general.sampling.*`` (llama.cpp's defaults)."""
    out: dict[str, Any] = {}
    if "tokenizer.ggml.tokens" in meta:
        if gen.eos_token_id:
            out["tokenizer.ggml.eos_token_id"] = gen.eos_token_id[0]
        if gen.bos_token_id is not None:
            out["tokenizer.ggml.bos_token_id"] = gen.bos_token_id
    if gen.do_sample and not gen.greedy:
        out.update({"general.sampling.temp": float(gen.temperature),
                    "general.sampling.top_k": gen.top_k,
                    "general.sampling.top_p": float(gen.top_p)})
    return out


def _tokenizer_config(checkpoint: Path) -> dict[str, Any]:
    """The ``tokenizer_config.json`` an import left beside the checkpoint (in it, or in the
    folder holding it), or nothing."""
    for folder in (checkpoint, checkpoint.parent):
        path = folder / "tokenizer_config.json"
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
                raise MeshtronError(f"{path} cannot be read as JSON ({err})") from None
            return config if isinstance(config, dict) else {}
    return {}


def _write(dst: Path, arch: str, meta: dict[str, Any],
           tensors: dict[str, tuple[Q, np.ndarray]]) -> None:
    """The GGUF file, written to a temporary name beside ``dst`` and renamed onto it."""
    tmp = dst.parent / f".tmp-{dst.name}-{os.getpid()}"
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_name("meshtron export")
        for key, value in meta.items():
            _add_value(writer, key, value)
        for name, (qtype, data) in tensors.items():
            writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dst)
    except OSError as err:
        raise MeshtronError(f"cannot write {dst} ({err.strerror or err})") from None
    finally:
        tmp.unlink(missing_ok=True)


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """One metadata value with the type llama.cpp reads it as (counts and ids uint32)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif key in INT32_KEYS:
        writer.add_int32(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)
