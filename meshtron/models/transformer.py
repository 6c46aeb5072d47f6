"""The decoder-only transformer, written once for both architectures and every layout.

``arch=llama``: RMSNorm, rotary positions, grouped-query attention, SwiGLU, no biases.
``arch=gpt2``: LayerNorm, learned positions, GELU, biases.

The model only knows the parallel layer types it is built from (column/row-parallel linears, a
vocab-parallel embedding and loss) and the tensor-parallel region it runs in; on a one-process
mesh those layers are plain linears and the region's communication is a no-op.

Parameter names are global and layout-free (``layers.{i}.attn.q.weight`` with ``i`` the global
layer index); checkpoints, initialisation and HF conversion all key on them. Fused projections
keep their parts in a fixed order: ``kv`` = [k heads | v heads], ``gate_up`` = [gate | up].
Queries and keys/values are separate projections so that each splits over tp on its own (kv
heads are replicated when tp > num_kv_heads).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtron.config import ModelConfig
from meshtron.models.moe import MoE
from meshtron.parallel.collectives import local_chunk
from meshtron.parallel.linear import FP8Options, linear
from meshtron.parallel.mesh import ParallelMesh
from meshtron.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPRegion,
    VocabParallelEmbedding,
    replicated,
    vocab_parallel_loss_sum,
)
from meshtron.parallel.weight_grad import WeightGradStore

if TYPE_CHECKING:
    from meshtron.parallel.partition import PipelinePlan

_SDPA_GQA = torch.__version__ >= "2.5"
"""``scaled_dot_product_attention`` takes ``enable_gqa`` (shares kv heads without copies)."""


def padded_vocab_size(cfg: ModelConfig) -> int:
    """Vocabulary rounded up to ``vocab_multiple``: the same under every layout."""
    assert cfg.vocab_size is not None, "model.vocab_size must be resolved before building"
    return math.ceil(cfg.vocab_size / cfg.vocab_multiple) * cfg.vocab_multiple


class _RMSNormFP32(torch.autograd.Function):
    """weight * x / rms(x) for fp32 x and weight, with a hand-written backward (autograd
    differentiates ``F.rms_norm`` op by op, which takes 1.4-2x as long on CPU)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        sum_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_()
        rstd = sum_sq.div_(x.shape[-1]).add_(eps).rsqrt_()
        normed = x * rstd
        ctx.save_for_backward(normed, weight, rstd)
        return normed * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        normed, weight, rstd = ctx.saved_tensors
        grad_weight = (grad * normed).flatten(0, -2).sum(0)
        grad_normed = grad * weight
        dot = (grad_normed * normed).mean(-1, keepdim=True)
        return grad_normed.sub_(normed * dot).mul_(rstd), grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            return _RMSNormFP32.apply(x, self.weight, self.eps)
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


def make_norm(cfg: ModelConfig, region: TPRegion) -> nn.Module:
    norm = (RMSNorm(cfg.hidden_size, cfg.norm_eps) if cfg.arch == "llama"
            else nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps))
    for param in norm.parameters():
        replicated(param, region)
    return norm


class Rotary(nn.Module):
    """Rotary position embedding (the half-split convention of HF Llama)."""

    def __init__(self, head_dim: int, max_len: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Rotate ``x`` of shape [b, heads, s, head_dim] for positions start..start+s-1."""
        s = x.shape[-2]
        cos = self.cos[start : start + s].to(x.dtype)
        sin = self.sin[start : start + s].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache:
    """Pre-allocated keys and values for incremental decoding."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store this layer's new keys/values at the current length; return all so far."""
        end = self.length + k.shape[-2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class Attention(nn.Module):
    """Self-attention with heads split over tp; kv heads split or, when fewer than tp ranks,
    shared by groups of tp / num_kv_heads ranks."""

    def __init__(self, cfg: ModelConfig, layer: int, region: TPRegion, mesh: ParallelMesh):
        super().__init__()
        tp = region.size
        self.layer = layer
        self.region = region
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.num_heads = cfg.num_heads // tp
        kv_pieces = min(tp, cfg.num_kv_heads)
        self.num_kv_heads = cfg.num_kv_heads // kv_pieces
        share = mesh.tp_subgroup(tp // kv_pieces) if kv_pieces < tp else None
        bias = cfg.arch == "gpt2"
        self.q = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * self.head_dim, bias, region)
        self.kv = ColumnParallelLinear(cfg.hidden_size, 2 * cfg.num_kv_heads * self.head_dim,
                                       bias, region, parts=2, pieces=kv_pieces, share_group=share)
        self.proj = RowParallelLinear(cfg.num_heads * self.head_dim, cfg.hidden_size, bias, region)
        self.dropout = cfg.dropout
        self.selective_recompute = False

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v, causal unless an explicit mask is given."""
        gqa = {}
        if self.num_kv_heads != self.num_heads:
            # Measured on CPU only: on GPUs which kernels take GQA depends on dtype and torch
            # version (fp32 may fall back to the math kernel), so they keep the copies.
            if _SDPA_GQA and q.device.type == "cpu":
                gqa = {"enable_gqa": True}
            else:
                repeat = self.num_heads // self.num_kv_heads
                k = k.repeat_interleave(repeat, dim=1)
                v = v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and q.shape[-2] > 1,
            dropout_p=self.dropout if self.training else 0.0, **gqa,
        )

    def forward(self, x: torch.Tensor, rotary: Rotary | None,
                cache: KVCache | None = None) -> torch.Tensor:
        x = self.region.enter(x)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
                for t in self.kv(x).chunk(2, dim=-1))
        start = cache.length if cache is not None else 0
        if rotary is not None:
            q, k = rotary(q, start), rotary(k, start)
        mask = None
        if cache is not None:
            k, v = cache.append(self.layer, k, v)
            if start > 0 and s > 1:  # a chunk after a prefix: causal within the chunk
                keys = torch.arange(start + s, device=x.device)
                mask = keys[None, :] <= (start + torch.arange(s, device=x.device))[:, None]
        if self.selective_recompute and self.training:
            y = checkpoint(self.core, q, k, v, mask, use_reentrant=False)
        else:
            y = self.core(q, k, v, mask)
        y = y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return F.dropout(self.proj(y), self.dropout, self.training)


class MLP(nn.Module):
    """SwiGLU (llama) or GELU (gpt2) feed-forward block, split over tp by hidden units."""

    def __init__(self, cfg: ModelConfig, region: TPRegion, ffn: int | None = None):
        super().__init__()
        self.region = region
        self.gated = cfg.arch == "llama"
        ffn = ffn or cfg.ffn_hidden_size
        if self.gated:
            self.gate_up = ColumnParallelLinear(cfg.hidden_size, 2 * ffn, False, region, parts=2)
        else:
            self.up = ColumnParallelLinear(cfg.hidden_size, ffn, True, region)
        self.down = RowParallelLinear(ffn, cfg.hidden_size, not self.gated, region)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.region.enter(x)
        if self.gated and (self.gate_up.grad_store is not None or self.gate_up.fp8 is not None):
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.gated:
            # Two products with the [gate | up] halves of the weight: contiguous outputs, and
            # backward concatenates weight-sized gradients rather than activation-sized ones.
            gate, up = (F.linear(x, w) for w in self.gate_up.weight.chunk(2))
            h = F.silu(gate) * up
        else:
            h = F.gelu(self.up(x), approximate="tanh")
        return F.dropout(self.down(h), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, region: TPRegion, mesh: ParallelMesh):
        super().__init__()
        self.attn_norm = make_norm(cfg, region)
        self.attn = Attention(cfg, layer, region, mesh)
        self.mlp_norm = make_norm(cfg, region)
        if cfg.is_moe_layer(layer):
            moe = cfg.moe
            shared = (MLP(cfg, region, moe.shared_experts * moe.expert_ffn_size)
                      if moe.shared_experts else None)
            self.mlp: MLP | MoE = MoE(cfg, region, mesh, shared)
        else:
            self.mlp = MLP(cfg, region)

    def forward(self, x: torch.Tensor, rotary: Rotary | None,
                cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rotary, cache)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Token ids [batch, seq] -> this rank's logits [batch, seq, padded vocab / tp].

    Under sequence parallelism the residual stream between blocks holds seq / tp positions per
    rank; the embedding reduce-scatters into it and the output layer gathers out of it.

    With a :class:`PipelinePlan` the module holds only this pipeline stage's chunks of layers
    (``layers`` is keyed by the global layer index), the embedding only on the first stage and
    the final norm and output layer only on the last; ``forward(x, chunk=c)`` runs one chunk,
    taking token ids into the first chunk of the model and hidden states into the others.
    With tied embeddings and several stages the last stage keeps a copy of the embedding as its
    output weight (global name ``embed.weight``); the two copies' gradients are summed over
    ``mesh.pipeline_ends`` so they stay equal.
    """

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh | None = None,
                 sequence_parallel: bool = False, plan: PipelinePlan | None = None):
        super().__init__()
        mesh = mesh or ParallelMesh.single()
        region = TPRegion(mesh.tp, sequence_parallel and mesh.tp.size > 1)
        stage = mesh.pp.rank
        self.cfg = cfg
        self.region = region
        self.vocab_size = cfg.vocab_size
        self.padded_vocab = padded_vocab_size(cfg)
        self.chunks = plan.chunks_of(stage) if plan else [list(range(cfg.num_layers))]
        self.has_embedding = plan is None or plan.holds_embedding(stage)
        self.has_head = plan is None or plan.holds_head(stage)
        head_dim = cfg.hidden_size // cfg.num_heads
        if self.has_embedding:
            self.embed = VocabParallelEmbedding(self.padded_vocab, cfg.hidden_size, region)
        self.rotary = None
        if cfg.arch == "gpt2":
            if self.has_embedding:
                self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
                replicated(self.pos_embed.weight, region)
        else:
            self.rotary = Rotary(head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, region, mesh)
                                     for chunk in self.chunks for i in chunk})
        if self.has_head:
            self.final_norm = make_norm(cfg, region)
            if not cfg.tie_embeddings or not self.has_embedding:
                self.output = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab, False,
                                                   region)
        if cfg.tie_embeddings and mesh.pp.size > 1 and (self.has_embedding or self.has_head):
            tied = self.embed.weight if self.has_embedding else self.output.weight
            tied.pipeline_copies = 2  # counted once in the grad norm
            tied.grad_sync = mesh.pipeline_ends
            if not self.has_embedding:
                tied.global_name = "embed.weight"  # the copy: initialised, loaded, never saved
        self.recompute = "none"
        self.grad_store: WeightGradStore | None = None

    def split_weight_grads(self, store: WeightGradStore | None) -> None:
        """Let every linear layer (and the output layer) defer its weight gradient to
        ``store`` while the store is deferring (zero-bubble schedules); None undoes it."""
        self.grad_store = store
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.grad_store = store

    def use_fp8(self, make_options: Callable[[], FP8Options]) -> None:
        """Run the linear layers of the transformer blocks in FP8, each with its own options
        (and so its own amax history); embeddings, norms and the output layer stay as they
        are."""
        for block in self.layers.values():
            for module in block.modules():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    module.fp8 = make_options()

    def blocks(self) -> list[Block]:
        """This rank's transformer blocks in the order its forward passes run them."""
        return [self.layers[str(i)] for chunk in self.chunks for i in chunk]

    def moe_layers(self) -> dict[int, MoE]:
        """This rank's mixture-of-experts layers by global layer index."""
        return {int(i): block.mlp for i, block in self.layers.items()
                if isinstance(block.mlp, MoE)}

    def set_aux_loss_weight(self, weight: float) -> None:
        """The gradient the MoE auxiliary losses get per unit (the weight of the language-model
        loss sum: loss scale / global tokens)."""
        for layer in self.moe_layers().values():
            layer.loss_weight = weight

    @property
    def output_weight(self) -> torch.Tensor:
        if self.cfg.tie_embeddings and self.has_embedding:
            return self.embed.weight
        return self.output.weight

    def set_recompute(self, mode: str) -> None:
        """``full`` recomputes whole layers in backward, ``selective`` only attention cores."""
        self.recompute = mode
        for block in self.layers.values():
            block.attn.selective_recompute = mode == "selective"

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.output_weight
        return KVCache(self.cfg.num_layers, batch, self.blocks()[0].attn.num_kv_heads, max_len,
                       self.cfg.hidden_size // self.cfg.num_heads, p.dtype, p.device)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                chunk: int = 0) -> torch.Tensor:
        """Logits of token ids ``x``; in a pipeline, chunk ``chunk`` of this stage: token ids
        or hidden states in, hidden states or (from the model's last chunk) logits out."""
        new_tokens = x.shape[1]
        if self.has_embedding and chunk == 0:
            x = self.embed_tokens(x, cache.length if cache is not None else 0)
        for i in self.chunks[chunk]:
            block = self.layers[str(i)]
            if self.recompute == "full" and self.training:
                x = checkpoint(block, x, self.rotary, use_reentrant=False)
            else:
                x = block(x, self.rotary, cache)
        if not (self.has_head and chunk == len(self.chunks) - 1):
            return x
        if cache is not None:  # generation: one process, one chunk
            cache.length += new_tokens
        x = self.region.enter(self.final_norm(x))
        return linear(x, self.output_weight, None, self.grad_store)

    def embed_tokens(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        x = self.embed(tokens)
        if self.rotary is None:
            positions = self.pos_embed(
                torch.arange(start, start + tokens.shape[1], device=tokens.device))
            if self.region.sequence_parallel:
                positions = local_chunk(positions, self.region.group, dim=0)
            x = x + positions
        return F.dropout(x, self.cfg.dropout, self.training)

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of token cross-entropies in fp32; padded vocabulary entries never count."""
        start = self.region.group.rank * logits.shape[-1]
        return vocab_parallel_loss_sum(logits, targets, self.region.group, start,
                                       self.vocab_size)
