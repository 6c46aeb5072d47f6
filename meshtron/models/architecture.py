"""What describes an architecture: its block spec and its Hugging Face form.

An :class:`Architecture` says which parts a transformer block is made of (the norm, the
attention module, rotary or learned positions, a gated or plain MLP and its gate, biases,
norms after attention and MLP, scaled embeddings); the shared block
code in
:mod:`meshtron.models.blocks` and the size and FLOP formulas in :mod:`meshtron.models.flops`
read these fields and nothing else. Its :class:`HFFormat` maps the model to and from a Hugging
Face ``transformers`` family: tensors by one table of :class:`TensorRule` read in both
directions, config fields by one table of field pairs, plus what the family cannot express.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import ModelConfig
from meshtron.errors import MeshtronError


@dataclass(frozen=True)
class TensorRule:
    """Meshtron tensors ``ours`` concatenated along dim 0 hold the same values as HF tensors
    ``theirs`` (each transposed when ``transpose``: GPT-2's Conv1D stores [in, out])
    concatenated along dim 0. Several HF tensors are equal slices; several of ours take the
    rows their shapes say. No HF tensor (``theirs`` empty): ours is meshtron-only state, left
    out of an export and zero after an import. Names may hold ``{j}``, an expert's index."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    transpose: bool = False


class HFConfig:
    """An HF ``config.json`` as read on import: values with the family's class defaults,
    positive-integer fields checked, refusals as one line naming the file."""

    INT_FIELDS = frozenset((
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "n_embd",
        "n_layer", "n_head", "n_inner", "n_positions", "num_local_experts",
        "num_experts_per_tok", "num_experts", "head_dim", "sliding_window",
        "moe_intermediate_size", "decoder_sparse_step", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_group", "topk_group"))

    def __init__(self, raw: Mapping[str, Any], defaults: Mapping[str, Any], where: str):
        self.raw = raw
        self.defaults = defaults
        self.where = where

    def get(self, key: str) -> Any:
        value = self.raw[key] if key in self.raw else self.defaults[key]
        if key in self.INT_FIELDS and value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            self.refuse(f"'{key}' must be a positive integer, got {value!r}")
        return value

    def require(self, ok: bool, reason: str) -> None:
        if not ok:
            self.refuse(reason)

    def refuse(self, reason: str) -> None:
        raise MeshtronError(f"{self.where}: {reason}")

    def saved(self) -> dict[str, Any]:
        """The ``meshtron`` block a meshtron export writes into config.json (empty if none)."""
        saved = self.raw.get("meshtron")
        return saved if isinstance(saved, dict) else {}


@dataclass(frozen=True)
class HFModelType:
    """One ``model_type`` of ``transformers`` read (and, for the first of a family, written)."""

    name: str
    display: str
    class_name: str
    defaults: Mapping[str, Any]
    """The ``transformers`` class defaults of the fields read, for config.json files that
    omit them."""


@dataclass(frozen=True)
class HFFormat:
    """A Hugging Face family: the names and layouts of its tensors and config fields."""

    model_types: tuple[HFModelType, ...]
    """The model types read as this family; an export writes the first."""
    fields: tuple[tuple[str, str], ...]
    """(ModelConfig field, HF config key) pairs that carry the same value both ways."""
    to_config: Callable[[ModelConfig], dict[str, Any]]
    """Further HF config fields of an export (beyond ``fields`` and the vocabulary)."""
    from_config: Callable[[HFConfig, dict[str, Any]], None]
    """Checks an imported config.json and completes the ModelConfig fields (given as the
    values read through ``fields``) with what the table cannot say."""
    layer_prefix: str
    """HF name prefix of layer ``{i}``; ours is ``layers.{i}.``."""
    layer_rules: tuple[TensorRule, ...]
    global_rules: tuple[TensorRule, ...]
    head: str
    """The LM head's HF name: our ``output.weight``, or the embedding when tied."""
    base_prefix: str
    """The prefix of every tensor but the LM head: files saved from the base model class
    lack it."""
    refusals: Callable[[ModelConfig], str | None] = lambda cfg: None
    """Why a model of this architecture has no HF twin (one line), or None."""
    saved: Callable[[ModelConfig], dict[str, Any]] = lambda cfg: {}
    """Settings kept under ``meshtron`` in an exported config.json, beyond the vocabulary, so
    that importing it back restores them."""
    accepts: Callable[[ModelConfig], bool] = lambda cfg: True
    """Whether a model of ``cfg`` exports as this family: an architecture's variants are
    tried in order before its main format (a llama with q/k norms is Qwen3)."""
    mtp_rules: tuple[TensorRule, ...] = ()
    """A multi-token-prediction layer's tensors beyond a block's (its layer prefix holds the
    layer index after the decoder's); empty: the family has no such layers."""
    mtp_copies: tuple[str, str] | None = None
    """The HF names, under an MTP layer's prefix, of its copies of the embedding and of the
    LM head (written on export, checked equal to the shared ones on import)."""
    unexpected: Callable[[ModelConfig, str], str | None] = lambda cfg, name: None
    """Why an HF tensor that a model of ``cfg`` lacks is refused, when the family knows
    better than "not in the model" (DeepSeek's multi-token-prediction layers); None: it
    does not."""


@dataclass(frozen=True)
class Architecture:
    """One decoder architecture: the parts of its blocks and its Hugging Face form."""

    name: str
    norm: Callable[[int, float], nn.Module]
    """Builds a block's norm from (width, eps), and the per-head q/k norms
    (``model.qk_norm``)."""
    norm_vectors: int
    """Parameter vectors of one norm: 1 (RMSNorm's weight) or 2 (LayerNorm's weight, bias)."""
    rotary: bool
    """Rotary positions inside attention, else learned absolute positions on the embedding."""
    gated_mlp: bool
    """SwiGLU MLPs (and experts) with fused [gate | up], else GELU with one up projection."""
    bias: bool
    """Biases on every linear layer of the blocks."""
    attention: type[nn.Module]
    """The attention module class, built as ``attention(cfg, layer, arch, region, mesh, mode,
    selective_recompute)`` and called as ``(x, rotary, cache, sequence)``; its static
    ``matmul_params(cfg)``, ``other_params(cfg, bias)`` and ``score_width(cfg)`` size it (for
    parameter counts and FLOPs), ``rotary(cfg)`` builds its positions and ``new_cache`` its KV
    cache. Grouped-query attention (:class:`meshtron.models.blocks.Attention`) or multi-head
    latent attention (:class:`meshtron.models.latent.LatentAttention`)."""
    gate: Callable[[torch.Tensor], torch.Tensor] = F.silu
    """The gated MLP's activation of its gate: silu (SwiGLU) or tanh-approximated GELU
    (Gemma's GeGLU)."""
    embed_scale: bool = False
    """Token embeddings multiplied by sqrt(hidden_size) (Gemma), rounded to the model's dtype
    as transformers does."""
    post_norms: bool = False
    """A norm on the attention's and on the MLP's output before each joins the residual
    stream (Gemma's norms on both sides of each part)."""
    hf: HFFormat | None = None
    hf_variants: tuple[HFFormat, ...] = ()
    """Further Hugging Face families built from the same blocks (Qwen2, Qwen3 for llama),
    each exporting the models its ``accepts`` claims; all of them import."""
    latent: str | None = None
    """The registry name of this architecture with multi-head latent attention
    (``model.attention=mla``: a llama with it is the DeepSeek entry)."""
    experts: str | None = None
    """The registry name of this architecture with routed experts (a llama with experts is
    the Mixtral-style entry); None: experts change only the MLP."""
    notes: tuple[str, ...] = field(default=())
    """Published models this entry covers (for docs)."""

    def hf_formats(self) -> tuple[HFFormat, ...]:
        """Every Hugging Face family of this architecture, in the order exports try them."""
        return (*self.hf_variants, *((self.hf,) if self.hf is not None else ()))

    def hf_format_of(self, cfg: ModelConfig) -> HFFormat | None:
        """The family a model of ``cfg`` exports as (None: the architecture has none)."""
        return next((fmt for fmt in self.hf_formats() if fmt.accepts(cfg)), None)
