"""GGUF tensor names and llama.cpp's q/k row order, shared by the GGUF import and export.

Names come from the ``gguf`` package's own table (``gguf.get_tensor_name_map``: Hugging Face
module names -> ``blk.N.attn_q`` ...), applied to the Hugging Face names meshtron's HF mapping
already produces, so no tensor mapping is written here.

llama.cpp's converter reorders the rows of each llama q and k projection (and their biases):
within every head, the rotary pairs that Hugging Face keeps as two halves (dimension i with
i + d/2) become adjacent rows (2i, 2i + 1), the layout of llama.cpp's rope. The import undoes
it, the export redoes it; Qwen files are not reordered.
"""

from __future__ import annotations

import re

import gguf
import torch

from meshtron.errors import MeshtronError

_QK = re.compile(r"\.self_attn\.(q|k)_proj\.(weight|bias)$")


def gguf_names(arch: str, num_layers: int, hf_names: list[str]) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name, for a model of ``arch`` (a GGUF architecture)."""
    kind = next(k for k, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    table = gguf.get_tensor_name_map(kind, num_layers)
    out = {}
    for name in hf_names:
        mapped = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise MeshtronError(f"tensor '{name}' has no GGUF {arch} name")
        out[name] = mapped
    return out


def qk_heads(hf_name: str, heads: int, kv_heads: int) -> int | None:
    """The head count whose rows llama.cpp reorders in ``hf_name`` (None: not q or k)."""
    match = _QK.search(hf_name)
    if match is None:
        return None
    return heads if match.group(1) == "q" else kv_heads


def to_llama_cpp_order(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face rows (per head: first halves, then second halves) -> llama.cpp's
    (the two halves interleaved)."""
    rows = tensor.shape[0]
    return (tensor.reshape(heads, 2, rows // heads // 2, *tensor.shape[1:]).transpose(1, 2)
            .reshape(tensor.shape))


def from_llama_cpp_order(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`to_llama_cpp_order`."""
    rows = tensor.shape[0]
    return (tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:]).transpose(1, 2)
            .reshape(tensor.shape))
