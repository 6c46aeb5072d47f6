"""Multi-head latent attention (MLA), as DeepSeek-V2/V3 and ``transformers``'
``DeepseekV3Attention`` compute it::

    q            = q_b(norm(q_a(x)))  or  q(x)        [heads, nope + rope]
    latent, k_r  = kv_a(x)                             [kv_lora_rank], [rope] (shared by heads)
    k_nope, v    = kv_b(norm(latent))                  [heads, nope], [heads, v_head_dim]
    q_r, k_r     = rotary(q_r), rotary(k_r)            DeepSeek's interleaved pairs
    y            = proj(softmax([q_nope, q_r] . [k_nope, k_r] * scale) v)

``scale`` is 1/sqrt(nope + rope), times yarn's (0.1 * mscale_all_dim * ln(factor) + 1)^2 when
the rotary frequencies are scaled (``model.rope.mscale_all_dim``).

Under tensor parallelism the heads split: ``q_b`` (or ``q``) and ``kv_b`` are column-parallel by
heads, ``proj`` row-parallel. The down projections ``q_a`` and ``kv_a`` and the latent norms are
small and stay whole on every tp rank; each rank's gradient of them covers only its own heads,
so it is summed over tp (their layout's ``grad_sync``), as for Qwen3's q/k norms. Sequence
parallelism gathers the block input as for grouped-query attention.

The KV cache keeps what the keys and values are made from: the normalised latent and the
rotated key, (kv_lora_rank + qk_rope_head_dim) values per token and layer, and expands them
with ``kv_b`` for a prefill; a decode step (one new token) folds ``kv_b`` into the query and
the output instead (the weight-absorbed decode), never expanding the cache.

Under context parallelism with ``parallel.cp_comm=ring`` the same two travel the ring instead
of per-head keys and values: every rank expands each block it meets with its ``kv_b`` weight
(passed to the ring, which differentiates the expansion again in backward), so one hop carries
(kv_lora_rank + qk_rope_head_dim) values per token rather than heads x (nope + rope + v).
When ``kv_b`` runs in FP8 or defers its weight gradient (zero-bubble schedules) the ring cannot
redo it, and the expanded keys and values travel as with ``all_to_all`` and ``all_gather``,
whose cores take values narrower or wider than the keys.

With a LoRA adapter on ``kv_b`` (``model.lora``) both the absorbed decode and the ring use the
adapted weight ``W + alpha / rank * B A`` (:meth:`LatentAttention.kv_b_weight`), so decoding
an adapted model equals decoding the merged one and the ring's gradient reaches A and B; an
adapter with dropout while training leaves the ring to the expanded keys and values (the
dropout acts on the latent, which one merged weight cannot express).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from meshtron.config import ModelConfig
from meshtron.models.architecture import Architecture
from meshtron.models.blocks import AttentionCore, KVCache
from meshtron.models.norms import RMSNorm
from meshtron.models.rotary import Rotary
from meshtron.parallel.context.ring import ring_attention_of
from meshtron.parallel.context.sequence import Sequence
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPRegion,
    sliced,
)
from meshtron.parallel.tensor.linear import LinearMode


def softmax_scale(cfg: ModelConfig) -> float:
    """DeepSeek's softmax scale: 1/sqrt(q.k width), with yarn's mscale squared."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope
    if rope.scaling != "none" and rope.mscale_all_dim and rope.factor > 1:
        scale *= (0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0) ** 2
    return scale


LATENT_NORM_EPS = 1e-6
"""The latent norms' epsilon: DeepSeek's code and transformers build them with RMSNorm's
default, whatever the model's ``rms_norm_eps``."""


def whole_norm(width: int, region: TPRegion) -> RMSNorm:
    """A latent's RMSNorm: whole on every tp rank, its gradient summed over tp."""
    norm = RMSNorm(width, LATENT_NORM_EPS)
    sliced(norm.weight, (width,), None, region.size, region.group if region.size > 1 else None)
    return norm


def whole_linear(in_features: int, out_features: int, region: TPRegion,
                 mode: LinearMode) -> ColumnParallelLinear:
    """A down projection every tp rank computes whole (one piece shared by all tp ranks, its
    gradient summed over tp)."""
    return ColumnParallelLinear(in_features, out_features, False, region, pieces=1,
                                share_group=region.group, mode=mode)


class LatentAttention(AttentionCore):
    """Multi-head latent attention with heads split over tp (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layer: int, arch: Architecture, region: TPRegion,
                 mesh: ParallelMesh, mode: LinearMode, selective_recompute: bool = False):
        super().__init__()
        h, tp = cfg.hidden_size, region.size
        self.layer = layer
        self.region = region
        self.num_heads = cfg.num_heads // tp
        self.nope, self.rope_dim, self.v_dim = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                cfg.v_head_dim)
        self.kv_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope_dim
        heads = cfg.num_heads
        self.compressed = bool(cfg.q_lora_rank)
        if self.compressed:
            self.q_a = whole_linear(h, cfg.q_lora_rank, region, mode)
            self.q_a_norm = whole_norm(cfg.q_lora_rank, region)
            self.q_b = ColumnParallelLinear(cfg.q_lora_rank, heads * qk, False, region, mode=mode)
        else:
            self.q = ColumnParallelLinear(h, heads * qk, False, region, mode=mode)
        self.kv_a = whole_linear(h, self.kv_rank + self.rope_dim, region, mode)
        self.kv_a_norm = whole_norm(self.kv_rank, region)
        self.kv_b = ColumnParallelLinear(self.kv_rank, heads * (self.nope + self.v_dim), False,
                                         region, mode=mode)
        self.proj = RowParallelLinear(heads * self.v_dim, h, False, region, mode=mode)
        # SDPA divides by sqrt(q.k width): the rest of DeepSeek's scale multiplies the queries
        self.query_scale = softmax_scale(cfg) * math.sqrt(qk)
        self.window = None
        self.dropout = cfg.dropout
        self.selective_recompute = selective_recompute
        self.cp, self.cp_comm = mesh.cp, mesh.layout.cp_comm
        self.absorb = True
        """Decode steps take the weight-absorbed path (:meth:`absorbed_core`)."""
        # the latent travels the ring when kv_b is a plain product the ring can redo itself
        self.latent_ring = (self.cp.size > 1 and self.cp_comm == "ring"
                            and self.kv_b.fp8 is None and self.kv_b.grad_store is None)

    @staticmethod
    def matmul_params(cfg: ModelConfig) -> int:
        """The query (direct, or down and up), latent (down, up) and output weights."""
        h, heads, q_rank = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        query = (h * q_rank + q_rank * heads * qk) if q_rank else h * heads * qk
        latent = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) \
            + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return query + latent + heads * cfg.v_head_dim * h

    @staticmethod
    def other_params(cfg: ModelConfig, bias: bool) -> int:
        """The two latent norms' weights (latent attention has no biases)."""
        return cfg.q_lora_rank + cfg.kv_lora_rank

    @staticmethod
    def score_width(cfg: ModelConfig) -> int:
        return cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)

    @staticmethod
    def rotary(cfg: ModelConfig) -> Rotary:
        """Positions on the rotary parts only, in DeepSeek's interleaved layout."""
        return Rotary(cfg.qk_rope_head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope,
                      interleaved=True)

    def new_cache(self, num_layers: int, batch: int, max_len: int, dtype: torch.dtype,
                  device: torch.device) -> KVCache:
        """Per layer and token: the normalised latent (as the "key") and the rotated shared
        key (as the "value")."""
        return KVCache(num_layers, batch, 1, max_len, self.kv_rank, dtype, device,
                       value_dim=self.rope_dim)

    def keys_values(self, latent: torch.Tensor, k_rope: torch.Tensor,
                    weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [b, heads, L, nope + rope] and values [b, heads, L, v] of this rank's heads from
        the normalised latent [b, L, kv_rank] and rotated shared key [b, L, rope]: through
        ``kv_b`` itself, or (the ring) a plain product with its ``weight``."""
        kv = self.kv_b(latent) if weight is None else F.linear(latent, weight)
        b, length, _ = latent.shape
        kv = kv.view(b, length, self.num_heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope.unsqueeze(1).expand(-1, self.num_heads, -1, -1)
        return torch.cat([k_nope, k_rope], dim=-1), v

    def expand(self, held: torch.Tensor, weight: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ring's expansion of a travelling block [b, L, kv_rank + rope] (latent | key)."""
        return self.keys_values(*held.split([self.kv_rank, self.rope_dim], dim=-1), weight)

    def kv_b_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's ``kv_b`` weight as the layer applies it: its adapter merged in when it
        has one (a frozen base held narrower computes in ``dtype``)."""
        weight, lora = self.kv_b.weight, self.kv_b.lora
        if lora is None:
            return weight
        return lora.merged(weight.to(dtype))

    def ring_carries_latent(self) -> bool:
        """Whether the latent travels the ring (see the module docstring): not when
        ``kv_b``'s adapter drops its input in training."""
        lora = self.kv_b.lora
        return self.latent_ring and (lora is None or not (lora.dropout and self.training))

    def ring_core(self, q: torch.Tensor, held: torch.Tensor,
                  sequence: Sequence) -> torch.Tensor:
        """Ring attention over the cp ranks with the latent travelling (see the module
        docstring), checkpointed under selective recompute."""
        args = (q, held, self.expand, (self.kv_b_weight(q.dtype),), self.cp, sequence)
        if self.selective_recompute and self.training:
            return checkpoint(ring_attention_of, *args, use_reentrant=False)
        return ring_attention_of(*args)

    def absorbed_core(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                      keep: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step without expanding the cache: ``kv_b``'s key half is folded into
        the query and its value half applied after the weighted sum of latents, so a step
        costs O(L · heads · kv_rank) rather than expanding all L cached latents to every
        head's keys and values. ``q`` [b, heads, 1, nope + rope] (already scaled), ``latent``
        [b, L, kv_rank], ``k_rope`` [b, L, rope] -> [b, heads, 1, v]; ``keep`` [b, >= L] hides
        left padding."""
        weight = self.kv_b_weight(q.dtype).view(self.num_heads, self.nope + self.v_dim,
                                                self.kv_rank)
        key_up, value_up = weight.split([self.nope, self.v_dim], dim=1)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        scores = (torch.einsum("bhsn,hnr,blr->bhsl", q_nope, key_up, latent)
                  + torch.einsum("bhsp,blp->bhsl", q_rope, k_rope))
        scores = scores / math.sqrt(self.nope + self.rope_dim)  # as SDPA scales the expansion
        if keep is not None:  # left padding (see KVCache.keep): the query is a real token
            scores = scores.masked_fill(~keep[:, None, None, : scores.shape[-1]], float("-inf"))
        wide = torch.promote_types(scores.dtype, torch.float32)  # fp32 at least, as SDPA
        probs = torch.softmax(scores.to(wide), dim=-1).to(q.dtype)
        return torch.einsum("bhsl,blr,hvr->bhsv", probs, latent, value_up)

    def forward(self, x: torch.Tensor, rotary: Rotary | None, cache: KVCache | None = None,
                sequence: Sequence | None = None) -> torch.Tensor:
        assert rotary is not None, "latent attention needs rotary positions"
        x = self.region.enter(x)
        b, s, _ = x.shape
        q = self.q_b(self.q_a_norm(self.q_a(x))) if self.compressed else self.q(x)
        q = q.view(b, s, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_norm(latent).unsqueeze(1)  # [b, 1, s, kv_rank]
        start = cache.length if cache is not None else 0
        positions = sequence.positions if sequence is not None else None
        q_rope = rotary(q_rope, start, positions)
        k_rope = rotary(k_rope.unsqueeze(1), start, positions)  # [b, 1, s, rope]
        if cache is not None:
            latent, k_rope = cache.append(self.layer, latent, k_rope)
        latent, k_rope = latent.squeeze(1), k_rope.squeeze(1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        if cache is None and sequence is not None and self.ring_carries_latent():
            y = self.ring_core(q, torch.cat([latent, k_rope], dim=-1), sequence)
        elif cache is not None and s == 1 and self.absorb and self.kv_b.fp8 is None:
            y = self.absorbed_core(q, latent, k_rope, cache.keep)
        else:
            k, v = self.keys_values(latent, k_rope)
            y = self.run_core(q, k, v, start, sequence, cache.keep if cache is not None else None)
        y = y.transpose(1, 2).reshape(b, s, self.num_heads * self.v_dim)
        return F.dropout(self.proj(y), self.dropout, self.training)


def latent_cache_bytes_per_token(cfg: ModelConfig, element_size: int) -> int:
    """What the cache keeps per token of one sequence: (kv_lora_rank + qk_rope_head_dim)
    values per layer."""
    return cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * element_size

