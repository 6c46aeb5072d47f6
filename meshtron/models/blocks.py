"""The parts of a transformer block, written once against the parallel layers.

Which parts a block has (its norm and attention, rotary or learned positions, a gated MLP,
biases) comes from
its :class:`~meshtron.models.architecture.Architecture`; how its linear layers compute (FP8, a
deferred weight gradient) from a :class:`~meshtron.parallel.tensor.linear.LinearMode`. Both
are fixed when the block is built.

Fused projections keep their parts in a fixed order: ``kv`` = [k heads | v heads], ``gate_up``
= [gate | up]. Queries and keys/values are separate projections so that each splits over tp on
its own (kv heads are replicated when tp > num_kv_heads).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtron.config import ModelConfig
from meshtron.models.architecture import Architecture
from meshtron.models.init import width_multiplier
from meshtron.models.moe import MoE
from meshtron.models.rotary import Rotary
from meshtron.parallel.context.attention import attend
from meshtron.parallel.context.sequence import Sequence, attention_mask
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.pipeline.partition import ATTENTION_HALF, MLP_HALF
from meshtron.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPRegion,
    column_products,
    entered_products,
    replicated,
    sliced,
)
from meshtron.parallel.tensor.linear import LinearMode


def make_norm(cfg: ModelConfig, arch: Architecture, region: TPRegion) -> nn.Module:
    norm = arch.norm(cfg.hidden_size, cfg.norm_eps)
    for param in norm.parameters():
        replicated(param, region)
    return norm


class KVCache:
    """Pre-allocated keys and values for incremental decoding: per layer, ``kv_heads`` keys of
    ``head_dim`` and values of ``value_dim`` (default: ``head_dim``) per token. Latent attention
    stores its latent as the one "key" and its rotary key as the "value"."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, value_dim: int | None = None):
        key_shape = (batch, kv_heads, max_len, head_dim)
        value_shape = (batch, kv_heads, max_len, value_dim or head_dim)
        self.keys = [torch.empty(key_shape, dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.values = [torch.empty(value_shape, dtype=dtype, device=device)
                       for _ in range(num_layers)]
        self.length = 0
        self.keep: torch.Tensor | None = None
        """[batch, max_len] booleans, False at left padding (batched prompts of different
        lengths): no real token attends to those keys. None: no padding."""

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one sequence takes, summed over the layers."""
        return sum((k[0, :, 0].numel() * k.element_size() + v[0, :, 0].numel() * v.element_size())
                   for k, v in zip(self.keys, self.values))

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store this layer's new keys/values at the current length; return all so far."""
        end = self.length + k.shape[-2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def head_norm(cfg: ModelConfig, arch: Architecture, region: TPRegion) -> nn.Module:
    """The architecture's norm over one head's width (Qwen3's and Gemma's q/k norms): every tp
    rank holds it whole but normalises only its own heads, so its gradient is summed over
    tp."""
    norm = arch.norm(cfg.head_size, cfg.norm_eps)
    for param in norm.parameters():
        sliced(param, tuple(param.shape), None, region.size,
               region.group if region.size > 1 else None)
    return norm


def window_mask(q_index: torch.Tensor, k_index: torch.Tensor, window: int,
                q_docs: torch.Tensor | None = None,
                k_docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal (within documents) and at most ``window - 1`` positions back, as HF's sliding
    window: key j is seen from query i when i - window < j <= i. Shape [b or 1, 1, Lq, Lk]."""
    near = (k_index[None, :] > q_index[:, None] - window)[None, None]
    return attention_mask(q_index, k_index, q_docs, k_docs) & near


def padding_mask(mask: torch.Tensor | None, start: int, s: int,
                 keep: torch.Tensor) -> torch.Tensor:
    """``mask`` (None: causal) for queries start..start+s-1, with the keys ``keep`` [b, L]
    marks False (left padding) hidden from every real query; a padding query still sees the
    padding before it, so no row is empty (an empty row would be NaN)."""
    total = start + s
    if mask is None:
        keys = torch.arange(total, device=keep.device)
        mask = attention_mask(keys[start:], keys, None, None)
    visible = keep[:, None, None, :total] | ~keep[:, None, start:total, None]
    return mask & visible


class AttentionCore(nn.Module):
    """What every attention module shares: the core over the whole sequence (spread over cp,
    recomputed under selective recompute) and the masks of cached decoding and windows. A
    subclass sets ``window``, ``dropout``, ``cp``, ``cp_comm`` and ``selective_recompute``."""

    window: int | None
    dropout: float
    cp_comm: str
    selective_recompute: bool

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None, sequence: Sequence | None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v over the whole sequence: causal (within documents when
        ``sequence`` has them) unless an explicit mask is given."""
        return attend(q, k, v, self.cp, sequence, self.cp_comm, mask=mask,
                      dropout=self.dropout if self.training else 0.0)

    def run_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               sequence: Sequence | None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The core for queries start.. over keys 0.., checkpointed under selective
        recompute; ``keep`` (a cache's, see :class:`KVCache`) masks left padding."""
        mask, sequence = self.mask(start, q.shape[-2], q.device, sequence)
        if keep is not None:
            mask = padding_mask(mask, start, q.shape[-2], keep)
        if self.selective_recompute and self.training:
            return checkpoint(self.core, q, k, v, mask, sequence, use_reentrant=False)
        return self.core(q, k, v, mask, sequence)

    def mask(self, start: int, s: int, device: torch.device,
             sequence: Sequence | None) -> tuple[torch.Tensor | None, Sequence | None]:
        """The explicit mask (None: plain causal) for queries start..start+s-1 over keys
        0..start+s-1, and the sequence left for the core to mask by (a sliding window folds
        documents into its own mask)."""
        keys = torch.arange(start + s, device=device)
        queries = keys[start:]
        if self.window is not None and start + s > self.window:
            docs = sequence.documents if sequence is not None else None
            if sequence is not None:  # after a cached prefix the keys are all before
                queries = sequence.global_index
                keys = queries if start == 0 else keys
            return window_mask(queries, keys, self.window, docs, docs), None
        if start > 0 and s > 1:  # a chunk after a cached prefix: causal within the chunk
            return attention_mask(queries, keys, None, None)[0, 0], sequence
        return None, sequence


class Attention(AttentionCore):
    """Self-attention with heads split over tp; kv heads split or, when fewer than tp ranks,
    shared by groups of tp / num_kv_heads ranks. Under context parallelism the core spans the
    cp ranks (``mesh.layout.cp_comm``: ring or all_to_all). ``selective_recompute`` recomputes
    the attention core in backward instead of keeping its intermediate state. Optional parts
    come from the config: q/k/v and output biases (split like their weights), per-head q/k
    RMSNorms before rotary, a sliding window."""

    def __init__(self, cfg: ModelConfig, layer: int, arch: Architecture, region: TPRegion,
                 mesh: ParallelMesh, mode: LinearMode, selective_recompute: bool = False):
        super().__init__()
        tp = region.size
        self.layer = layer
        self.region = region
        self.head_dim = cfg.head_size
        self.num_heads = cfg.num_heads // tp
        kv_pieces = min(tp, cfg.num_kv_heads)
        self.num_kv_heads = cfg.num_kv_heads // kv_pieces
        share = mesh.tp_subgroup(tp // kv_pieces) if kv_pieces < tp else None
        h, d = cfg.hidden_size, self.head_dim
        qkv_bias, proj_bias = arch.bias or cfg.qkv_bias, arch.bias or cfg.proj_bias
        self.q = ColumnParallelLinear(h, cfg.num_heads * d, qkv_bias, region, mode=mode)
        self.kv = ColumnParallelLinear(h, 2 * cfg.num_kv_heads * d, qkv_bias, region, parts=2,
                                       pieces=kv_pieces, share_group=share, mode=mode)
        self.proj = RowParallelLinear(cfg.num_heads * d, h, proj_bias, region, mode=mode)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = head_norm(cfg, arch, region), head_norm(cfg, arch, region)
        self.qk_norm = cfg.qk_norm
        # muP: scores by sqrt(d_base) / d, d_base = d / m the head width at the base width (heads
        # fixed as width grows), so SDPA's 1/sqrt(d) times 1/sqrt(m); exactly 1 at m = 1.
        # Gemma's query_pre_attn_scalar s: scores by 1/sqrt(s), SDPA's 1/sqrt(d) times sqrt(d/s)
        scalar = cfg.query_pre_attn_scalar
        self.query_scale = (1.0 / math.sqrt(width_multiplier(cfg))
                            * (math.sqrt(d / scalar) if scalar is not None else 1.0))
        self.window = cfg.layer_window(layer)  # with cp > 1 refused by the plan
        self.dropout = cfg.dropout
        self.selective_recompute = selective_recompute
        self.cp, self.cp_comm = mesh.cp, mesh.layout.cp_comm

    @staticmethod
    def matmul_params(cfg: ModelConfig) -> int:
        """The q, kv and output projection weights of one block."""
        width = cfg.head_size * cfg.num_heads
        return cfg.hidden_size * (width + 2 * cfg.num_kv_heads * cfg.head_size) \
            + width * cfg.hidden_size

    @staticmethod
    def other_params(cfg: ModelConfig, bias: bool) -> int:
        """Parameters of one block's attention outside its matrix products: q/k/v and output
        biases (``bias``: the architecture's everywhere), the per-head q and k norm weights."""
        d = cfg.head_size
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d if bias or cfg.qkv_bias else 0
        return qkv + (cfg.hidden_size if bias or cfg.proj_bias else 0) \
            + (2 * d if cfg.qk_norm else 0)

    @staticmethod
    def score_width(cfg: ModelConfig) -> int:
        """Per token and key, the multiply-adds of the scores and their product with the
        values, summed over heads: heads x (q.k width + value width)."""
        return 2 * cfg.num_heads * cfg.head_size

    @staticmethod
    def rotary(cfg: ModelConfig) -> Rotary:
        return Rotary(cfg.head_size, cfg.max_seq_len, cfg.rope_theta, cfg.rope,
                      local_theta=cfg.rope_local_theta)

    def new_cache(self, num_layers: int, batch: int, max_len: int, dtype: torch.dtype,
                  device: torch.device) -> KVCache:
        return KVCache(num_layers, batch, self.num_kv_heads, max_len, self.head_dim, dtype,
                       device)

    def forward(self, x: torch.Tensor, rotary: Rotary | None, cache: KVCache | None = None,
                sequence: Sequence | None = None) -> torch.Tensor:
        q, kv = column_products(self.region, x, (self.q, self.kv))
        b, s, _ = q.shape
        start = cache.length if cache is not None else 0
        positions = sequence.positions if sequence is not None else None
        if rotary is not None:  # windowed layers may have their own table (Gemma 3)
            rotary = rotary.for_layer(self.window is not None)
        q, k, v = self.heads(q, kv, rotary, start, positions)
        keep = None
        if cache is not None:
            k, v = cache.append(self.layer, k, v)
            keep = cache.keep
        y = self.run_core(q, k, v, start, sequence, keep)
        y = y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return F.dropout(self.proj(y), self.dropout, self.training)

    def heads(self, q: torch.Tensor, kv: torch.Tensor, rotary: Rotary | None, start: int,
              positions: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The projections' outputs as per-head q, k, v [b, heads, s, d]: q/k norms, rotary
        and muP's query scale, the elementwise work between the products and the core."""
        b, s, _ = q.shape
        q = q.view(b, s, self.num_heads, self.head_dim)
        k, v = (t.view(b, s, self.num_kv_heads, self.head_dim) for t in kv.chunk(2, dim=-1))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if rotary is not None:
            q, k = rotary(q, start, positions), rotary(k, start, positions)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        return q, k, v


class MLP(nn.Module):
    """SwiGLU or GELU feed-forward block, split over tp by hidden units."""

    def __init__(self, cfg: ModelConfig, arch: Architecture, region: TPRegion, mode: LinearMode,
                 ffn: int | None = None):
        super().__init__()
        self.region = region
        self.gated = arch.gated_mlp
        self.gate = arch.gate
        ffn = ffn or cfg.ffn_hidden_size
        h, bias = cfg.hidden_size, arch.bias or cfg.mlp_bias
        if self.gated:
            self.gate_up = ColumnParallelLinear(h, 2 * ffn, bias, region, parts=2, mode=mode)
        else:
            self.up = ColumnParallelLinear(h, ffn, bias, region, mode=mode)
        self.down = RowParallelLinear(ffn, h, bias, region, mode=mode)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated and (self.gate_up.grad_store is not None or self.gate_up.fp8 is not None
                           or self.gate_up.bias is not None or self.gate_up.lora is not None):
            gate, up = column_products(self.region, x, (self.gate_up,))[0].chunk(2, dim=-1)
            h = self.activation(gate, up)
        elif self.gated:
            # Two products with the [gate | up] halves of the weight: contiguous outputs, and
            # backward concatenates weight-sized gradients rather than activation-sized ones.
            gate, up = entered_products(self.region, x, self.gate_up.weight.chunk(2),
                                        (None, None))
            h = self.activation(gate, up)
        else:
            (up,) = column_products(self.region, x, (self.up,))
            h = self.activation(up)
        return F.dropout(self.down(h), self.dropout, self.training)

    def activation(self, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        """The architecture's gate of x times up (SwiGLU: silu; GeGLU: GELU), or GELU of the
        up projection."""
        return F.gelu(x, approximate="tanh") if up is None else self.gate(x) * up


class Block(nn.Module):
    """One transformer layer, or one half of it where a pipeline stage boundary cuts the layer
    between its attention and its MLP (``parts``): the two stages' halves keep the layer's
    global parameter names, so checkpoints and initialisation do not see the cut."""

    def __init__(self, cfg: ModelConfig, layer: int, arch: Architecture, region: TPRegion,
                 mesh: ParallelMesh, mode: LinearMode, selective_recompute: bool,
                 aux_loss_weight: Callable[[], float],
                 parts: tuple[str, ...] = (ATTENTION_HALF, MLP_HALF)):
        super().__init__()
        mode = mode.for_layer(layer)  # the per-layer precision policy asks by block index
        self.has_attention, self.has_mlp = ATTENTION_HALF in parts, MLP_HALF in parts
        self.post_norms = arch.post_norms
        if self.has_attention:
            self.attn_norm = make_norm(cfg, arch, region)
            self.attn = arch.attention(cfg, layer, arch, region, mesh, mode, selective_recompute)
            if self.post_norms:
                self.attn_post_norm = make_norm(cfg, arch, region)
        if not self.has_mlp:
            return
        self.mlp_norm = make_norm(cfg, arch, region)
        if self.post_norms:
            self.mlp_post_norm = make_norm(cfg, arch, region)
        if cfg.is_moe_layer(layer):
            moe = cfg.moe
            shared = (MLP(cfg, arch, region, mode, moe.shared_experts * moe.expert_ffn_size)
                      if moe.shared_experts else None)
            self.mlp: MLP | MoE = MoE(cfg, region, mesh, shared, arch.gated_mlp,
                                      aux_loss_weight, mode.layer_experts())
        else:
            self.mlp = MLP(cfg, arch, region, mode)

    def compile_parts(self, whole: bool) -> None:
        """``torch.compile`` the block's forward, ``whole`` where nothing in it communicates;
        otherwise only its communication-free parts (the norms, attention's per-head work, the
        MLP's activation), so that every collective runs eagerly between the graphs and keeps
        its byte count. Module hooks (ZeRO-3's gathers and frees) stay outside the graphs."""
        if whole:
            self.forward = torch.compile(self.forward)  # type: ignore[method-assign]
            return
        for norm in ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm"):
            if hasattr(self, norm):
                getattr(self, norm).compile()
        if self.has_attention and isinstance(self.attn, Attention):
            self.attn.heads = torch.compile(self.attn.heads)  # type: ignore[method-assign]
        if self.has_mlp and isinstance(self.mlp, MLP):
            self.mlp.activation = torch.compile(self.mlp.activation)  # type: ignore

    def forward(self, x: torch.Tensor, rotary: Rotary | None, cache: KVCache | None = None,
                sequence: Sequence | None = None) -> torch.Tensor:
        if self.has_attention:
            y = self.attn(self.attn_norm(x), rotary, cache, sequence)
            x = x + (self.attn_post_norm(y) if self.post_norms else y)
        if not self.has_mlp:
            return x
        y = self.mlp(self.mlp_norm(x))
        return x + (self.mlp_post_norm(y) if self.post_norms else y)
