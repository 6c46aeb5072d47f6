"""A GGUF file's model metadata to and from a Hugging Face ``config.json`` dict.

The GGUF import goes through the Hugging Face one: the metadata (``llama.block_count``, ...)
becomes the ``config.json`` of the same model, which :func:`~.hf_config.hf_model_config` reads
with every check it already makes, and the export writes the metadata of the ``config.json``
meshtron would export. One table per architecture (:data:`ARCHITECTURES`) names the pairs
both ways.

The architectures are those llama.cpp writes for models meshtron computes exactly: ``llama``
(Llama, and Mistral without a sliding window, which llama.cpp also files as llama), ``qwen2``,
``qwen3`` and ``gpt2``. Anything else (a mixture of experts, rope scaling other than linear or
Llama 3.1's (:mod:`.gguf_rope`), a partial rotary dimension, separate key and value widths) is
refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshtron.errors import MeshtronError


@dataclass(frozen=True)
class GGUFArch:
    """How one GGUF architecture's metadata reads as its Hugging Face family's config.json."""

    hf_class: str
    keys: tuple[tuple[str, str], ...]
    """(config.json field, GGUF key after ``{arch}.``) pairs, used both ways."""
    required: int
    """How many of ``keys``, from the first, a file must have."""
    rotary: bool = True
    """Rotary llama-style blocks (kv heads, head width, rope base) rather than GPT-2's."""
    permuted_qk: bool = False
    """llama.cpp's converter reorders the q and k rows (rotary halves interleaved)."""
    transposed: tuple[str, ...] = ()
    """HF tensor names (suffixes) stored transposed in GGUF: GPT-2's Conv1D weights."""


LLAMA_KEYS = (
    ("hidden_size", "embedding_length"), ("num_hidden_layers", "block_count"),
    ("intermediate_size", "feed_forward_length"),
    ("num_attention_heads", "attention.head_count"),
    ("max_position_embeddings", "context_length"),
    ("num_key_value_heads", "attention.head_count_kv"),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    ("rope_theta", "rope.freq_base"),
)
GPT2_KEYS = (
    ("n_embd", "embedding_length"), ("n_layer", "block_count"),
    ("n_inner", "feed_forward_length"), ("n_head", "attention.head_count"),
    ("n_positions", "context_length"), ("layer_norm_epsilon", "attention.layer_norm_epsilon"),
)
ARCHITECTURES = {
    "llama": GGUFArch("LlamaForCausalLM", LLAMA_KEYS, 5, permuted_qk=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM", LLAMA_KEYS, 5),
    "qwen3": GGUFArch("Qwen3ForCausalLM", LLAMA_KEYS, 5),
    "gpt2": GGUFArch("GPT2LMHeadModel", GPT2_KEYS, 5, rotary=False, transposed=(
        "attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")),
}
"""GGUF ``general.architecture`` -> how it reads."""
DEFAULTS = {"rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5,
            "attention.layer_norm_epsilon": 1e-5}
"""llama.cpp's own defaults for keys a file may leave out."""
REFUSED_KEYS = {
    "expert_count": "mixture-of-experts GGUF files are not supported",
    "attention.sliding_window": "a sliding window is not supported in GGUF files",
    "attention.clamp_kqv": "clamped q/k/v activations are not supported",
}


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str], where: str
                        ) -> dict[str, Any]:
    """The ``config.json`` of the model a GGUF file's metadata describes."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise MeshtronError(f"{where}: unknown or unsupported architecture '{str(arch)[:80]}' "
                            f"(meshtron reads GGUF {', '.join(ARCHITECTURES)})")
    for key, why in REFUSED_KEYS.items():
        if meta.get(f"{arch}.{key}"):
            raise MeshtronError(f"{where}: {arch}.{key}={meta[f'{arch}.{key}']}: {why}")
    spec = ARCHITECTURES[arch]
    hf: dict[str, Any] = {"model_type": arch, "architectures": [spec.hf_class]}
    for i, (theirs, key) in enumerate(spec.keys):
        value = meta.get(f"{arch}.{key}", DEFAULTS.get(key))
        if value is None and i < spec.required:
            raise MeshtronError(f"{where}: the metadata lacks {arch}.{key}")
        if value is not None and (isinstance(value, (bool, list, str)) or value <= 0):
            raise MeshtronError(f"{where}: {arch}.{key} must be a positive number, got "
                                f"{str(value)[:80]}")
        hf[theirs] = value
    hf["vocab_size"] = _vocab_size(meta, arch, where)
    hf["tie_word_embeddings"] = "output.weight" not in tensor_names
    for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        hf[ours] = meta.get(f"tokenizer.ggml.{key}")
    if not spec.rotary:
        hf["activation_function"] = "gelu_new"  # llama.cpp's GPT-2 uses the tanh GELU
        _head_dim(meta, arch, hf["n_embd"], hf["n_head"], where)
        return hf
    hf["hidden_act"] = "silu"
    hf["num_key_value_heads"] = hf["num_key_value_heads"] or hf["num_attention_heads"]
    hf["head_dim"] = _head_dim(meta, arch, hf["hidden_size"], hf["num_attention_heads"], where)
    hf["rope_scaling"] = _rope_scaling(meta, arch, where)
    if arch == "llama":
        hf["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        hf["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    return hf


def _head_dim(meta: dict[str, Any], arch: str, hidden: int, heads: int, where: str) -> int:
    """``attention.key_length`` (default: the embedding over the heads), which the value width
    and the rotary dimension must equal (meshtron has one head width, rotated whole)."""
    key_length = meta.get(f"{arch}.attention.key_length")
    if key_length is None:
        if hidden % heads:
            raise MeshtronError(f"{where}: {arch}.attention.head_count={heads} does not divide "
                                f"{arch}.embedding_length={hidden} (and no "
                                f"{arch}.attention.key_length gives the head width)")
        key_length = hidden // heads
    value_length = meta.get(f"{arch}.attention.value_length", key_length)
    if value_length != key_length:
        raise MeshtronError(f"{where}: {arch}.attention.value_length={value_length} differs from "
                            f"the key width {key_length}, which meshtron does not support")
    rotary = meta.get(f"{arch}.rope.dimension_count", key_length)
    if rotary != key_length:
        raise MeshtronError(f"{where}: {arch}.rope.dimension_count={rotary} rotates part of the "
                            f"{key_length}-wide heads; partial rotary is not supported")
    return int(key_length)


def _rope_scaling(meta: dict[str, Any], arch: str, where: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind != "linear" or not isinstance(factor, (int, float)):
        raise MeshtronError(f"{where}: {arch}.rope.scaling.type={kind}: only linear rope "
                            "scaling (with its factor) and Llama 3.1's (rope_freqs.weight) are "
                            "read from GGUF files")
    return {"rope_type": "linear", "factor": float(factor)}


def _vocab_size(meta: dict[str, Any], arch: str, where: str) -> int:
    tokens = meta.get("tokenizer.ggml.tokens")
    size = meta.get(f"{arch}.vocab_size", len(tokens) if isinstance(tokens, list) else None)
    if not isinstance(size, int) or size <= 0:
        raise MeshtronError(f"{where}: neither {arch}.vocab_size nor tokenizer.ggml.tokens "
                            "gives the vocabulary size")
    if isinstance(tokens, list) and len(tokens) != size:
        raise MeshtronError(f"{where}: {arch}.vocab_size={size} disagrees with the "
                            f"{len(tokens)} tokens of tokenizer.ggml.tokens")
    return size


def gguf_metadata(hf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(GGUF architecture, ``{arch}.*`` metadata) of the model whose ``config.json`` meshtron
    exports as ``hf``; what GGUF cannot say is refused."""
    arch = hf["model_type"]
    if arch not in ARCHITECTURES:
        raise MeshtronError(f"this model exports as {arch}, which meshtron cannot write as GGUF "
                            f"(it writes {', '.join(ARCHITECTURES)})")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    if window:
        raise MeshtronError(f"model.sliding_window={window}: GGUF {arch} files have no "
                            "sliding window")
    if arch == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise MeshtronError("llama biases (model.qkv_bias / proj_bias / mlp_bias) cannot be "
                            "written as GGUF")
    spec = ARCHITECTURES[arch]
    meta: dict[str, Any] = {f"{arch}.{key}": hf[theirs] for theirs, key in spec.keys}
    meta[f"{arch}.vocab_size"] = hf["vocab_size"]
    if not spec.rotary:
        return arch, meta
    head_dim = hf["head_dim"]
    meta.update({f"{arch}.attention.key_length": head_dim,
                 f"{arch}.attention.value_length": head_dim,
                 f"{arch}.rope.dimension_count": head_dim})
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") == "linear":
        meta.update({f"{arch}.rope.scaling.type": "linear",
                     f"{arch}.rope.scaling.factor": rope["factor"]})
    elif rope.get("rope_type", "default") not in ("default", "llama3"):  # llama3: rope_freqs
        raise MeshtronError(f"rope scaling '{rope['rope_type']}' cannot be written as GGUF "
                            "(linear and llama3 can)")
    return arch, meta
