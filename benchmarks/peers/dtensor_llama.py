"""PyTorch's own tensor parallelism on a plain llama: the DTensor peer of the benchmarks.

:class:`Llama` is a single-device module with meshtron's math (names as in the PyTorch TP
tutorial, ``nn.RMSNorm``, SDPA with ``enable_gqa`` as meshtron uses on CPU);
:func:`parallelize_llama` splits it with ``parallelize_module`` as the tutorial does. Nothing
here knows meshtron: the caller copies the weights in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


@dataclass(frozen=True)
class LlamaShape:
    """The network's sizes (llama: SwiGLU, grouped-query attention, untied output)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 768
    vocab: int = 1024
    seq: int = 128


class Attention(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.head_dim = s.hidden // s.heads
        self.wq = nn.Linear(s.hidden, s.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(s.hidden, s.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(s.hidden, s.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(s.heads * self.head_dim, s.hidden, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: the local head count once the projections are split over tp
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, rope), rotate(k, rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


def rotate(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF llama's half-split convention (as meshtron)."""
    cos, sin = rope[0, : x.shape[-2]], rope[1, : x.shape[-2]]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class FeedForward(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.w1 = nn.Linear(s.hidden, s.ffn, bias=False)  # gate
        self.w3 = nn.Linear(s.hidden, s.ffn, bias=False)  # up
        self.w2 = nn.Linear(s.ffn, s.hidden, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, s: LlamaShape, eps: float):
        super().__init__()
        self.attention_norm = nn.RMSNorm(s.hidden, eps=eps)
        self.attention = Attention(s)
        self.ffn_norm = nn.RMSNorm(s.hidden, eps=eps)
        self.feed_forward = FeedForward(s)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """A plain single-device llama with meshtron's math (names as in the PyTorch TP tutorial)."""

    def __init__(self, s: LlamaShape, eps: float, theta: float):
        super().__init__()
        self.shape, self.theta = s, theta
        self.tok_embeddings = nn.Embedding(s.vocab, s.hidden)
        self.layers = nn.ModuleList(Block(s, eps) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.hidden, eps=eps)
        self.output = nn.Linear(s.hidden, s.vocab, bias=False)
        self.register_buffer("rope", torch.empty(2, s.seq, s.hidden // s.heads),
                             persistent=False)

    def init_rope(self) -> None:
        d = self.shape.hidden // self.shape.heads
        inv_freq = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(self.shape.seq, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.rope = torch.stack([angles.cos(), angles.sin()])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.layers:
            x = block(x, self.rope)
        return self.output(self.norm(x))


def _replicate_params(_: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh,
                                                                      [Replicate()])))


def _norm_in(_: nn.Module, inputs: tuple[Any, ...], device_mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
                 for x in inputs)


def _norm_out(_: nn.Module, output: torch.Tensor, __: DeviceMesh) -> torch.Tensor:
    return output.to_local() if isinstance(output, DTensor) else output


def parallelize_llama(model: Llama, mesh: DeviceMesh, sp: bool, per_linear: bool = False) -> None:
    """The PyTorch TP tutorial's plan (q/k/v/gate/up colwise, o/down rowwise, loss parallel).

    Attention and MLP inputs become one DTensor each (``PrepareModuleInput``), so backward
    sums the q/k/v (gate/up) input gradients before one all-reduce, as Megatron does; with
    ``per_linear`` (plain TP only) every column-parallel linear wraps its own input, the
    tutorial's first plan, and backward all-reduces each input gradient separately.
    """
    seq = Shard(1)
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=seq if sp else Replicate()),
        "output": ColwiseParallel(input_layouts=seq if sp else Replicate(),
                                  output_layouts=Shard(-1), use_local_output=False),
        **({"norm": SequenceParallel()} if sp else {}),
    })
    for block in model.layers:
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq if sp else Replicate()),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq if sp else Replicate()),
        }
        if sp:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        if sp or not per_linear:
            entering = seq if sp else Replicate()
            plan.update({
                "attention": PrepareModuleInput(input_layouts=(entering, None),
                                                desired_input_layouts=(Replicate(), None)),
                "feed_forward": PrepareModuleInput(input_layouts=(entering,),
                                                   desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(block, mesh, plan)
    if not sp:  # plain tensors cannot share an optimizer or clip_grad_norm_ with DTensors
        for norm in [model.norm, *(m for b in model.layers for m in (b.attention_norm,
                                                                     b.ffn_norm))]:
            distribute_module(norm, mesh, _replicate_params, _norm_in, _norm_out)
