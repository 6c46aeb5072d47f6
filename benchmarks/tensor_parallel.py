"""Tensor parallelism (tp=2, gloo, CPU): meshtron against PyTorch DTensor and megatron-core.

Run from the repository root::

    .venv/bin/python benchmarks/tensor_parallel.py [--steps N] [--json OUT] [--profile]

Every measurement runs in two processes spawned from this script (``torch.set_num_threads(1)``
and ``OMP_NUM_THREADS=1`` in each, gloo over a ``file://`` rendezvous); the parent only launches
them and prints. The training-step workers all import the same modules (meshtron and DTensor's
tensor-parallel API), so their baseline memory is the same; only the layer workers import
megatron-core (about 5 s and 100 MB).

1. **Training step** of a small llama (``--layers`` 4, hidden 256, 8 heads, 4 kv heads, SwiGLU
   768, ``--vocab`` 1024, sequence 128, micro-batch 4; fp32), tp=2, five variants:

   ``meshtron`` / ``meshtron+sp``
       ``meshtron.models.transformer.Transformer(cfg, ParallelMesh(MeshLayout(2, tp=2), rank),
       sequence_parallel=...)`` trained by ``meshtron.training.step.train_step`` (forward,
       vocab-parallel loss sum / tokens, backward, gradient sync, global grad norm, clip to
       ``train.grad_clip``, AdamW through ``DataParallelOptimizer`` with zero 0).
   ``dtensor`` / ``dtensor+sp`` / ``dtensor-per-linear``
       the same network written as a plain single-device module (:class:`Llama` below,
       the PyTorch TP tutorial's module names, ``nn.RMSNorm``, SDPA with ``enable_gqa`` as
       meshtron uses on CPU) and split by ``torch.distributed.tensor.parallel.parallelize_module``
       as in the tutorial: q/k/v/gate/up ``ColwiseParallel``, o/down ``RowwiseParallel``, the
       embedding ``RowwiseParallel(input_layouts=Replicate())``, the output layer
       ``ColwiseParallel(output_layouts=Shard(-1))`` with the loss under ``loss_parallel()``.
       ``dtensor`` puts ``PrepareModuleInput`` in front of attention and MLP, so each block
       input is one DTensor and backward all-reduces its gradient once (as meshtron and
       Megatron do); ``dtensor-per-linear`` (the tutorial's first plan) lets every
       column-parallel linear wrap its own input, so the q, k, v (gate, up) input gradients are
       all-reduced separately. ``+sp`` adds ``SequenceParallel`` norms and shards the
       embedding and row-parallel outputs on the sequence. The step is the same as meshtron's:
       ``F.cross_entropy(reduction="sum") / tokens``, ``clip_grad_norm_`` to the same max norm,
       the same AdamW groups and hyper-parameters. Norm weights, which the plan without SP
       leaves as plain tensors, are made ``Replicate`` DTensors there (an optimizer and
       ``clip_grad_norm_`` cannot mix the two kinds).

   Both models get exactly meshtron's initial weights (``meshtron.models.init.initial_value``
   of each global parameter, sliced); the losses of all variants are checked to agree (1e-4
   relative) at the first and at the last warm-up step, which covers gradients, clipping and
   the optimizer too.

   **Time**: one process pair builds all variants and, after ``--warmup`` steps each, runs
   ``--steps`` rounds in which every variant takes one step, the order rotating every round (a
   barrier aligns the two ranks before each step). Figures are rank 0's medians; ratio =
   median / median of the faster DTensor plan with the same SP setting; pair ratio = median
   over rounds of (step / that DTensor plan's step in the same round).

   **Memory**: a fresh process pair per variant builds only that variant and takes
   ``--warmup`` + ``--memory-steps`` steps; every variant runs twice, with glibc's default
   heap and with ``MALLOC_MMAP_THRESHOLD_=65536`` ("exact": every block of 64 KiB or more is
   its own mapping, returned when freed, so the high-water mark follows live memory instead of
   the heap glibc retains). Peak RSS is the high-water mark of the process's own address space
   (``VmHWM`` in ``/proc/self/status``): ``getrusage(RUSAGE_SELF).ru_maxrss`` is not used
   because in a spawned child it starts from the parent's peak (Linux carries the
   pre-``exec`` maximum over), so it would measure this launcher. "Training rise" is the rise
   of the peak during training (the mark is reset through ``/proc/self/clear_refs`` once the
   model is built): activations, gradients, optimizer state, communication buffers. "Saved
   activations" is exact: the bytes of the distinct storages autograd saves for backward in
   one step (``saved_tensors_hooks``; weights excluded). Memory ratios are against the DTensor
   plan with the lowest figure in that column and the same SP setting.

   ``--profile`` adds a ``torch.profiler`` breakdown of a few steps per variant (rank 0):
   self time in collectives including waiting for the peer, in matmul and SDPA kernels, in
   other aten ops, and the rest (Python, autograd engine, DTensor dispatch).

2. **Layer pair against megatron-core** (when it is installed: ``pip install -e '.[bench]'``):
   meshtron's ``TPRegion.enter`` -> ``ColumnParallelLinear`` -> ``RowParallelLinear`` (the
   MLP's pattern) and megatron-core's ``ColumnParallelLinear(gather_output=False)`` ->
   ``RowParallelLinear(input_is_parallel=True)`` (``initialize_model_parallel`` on gloo,
   ``use_cpu_initialization=True``, ``perform_initialization=False``: the weights are copied
   in), no bias, fp32, input [4, 128, ``--layer-hidden`` 1024] (512 tokens), FFN
   ``--layer-ffn`` 4096. Outputs, input gradients and each rank's weight gradients are compared
   (max abs difference over both ranks, asserted <= 1e-5). Forward+backward iterations
   alternate between the two (A/B, then B/A), ``--layer-steps`` each after 3 warm-up; medians on
   rank 0. megatron-core's sequence-parallel path is also tried, and the error it stops with on
   CPU is printed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import host_info, spawn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
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
    loss_parallel,
    parallelize_module,
)

from meshtron.config import Config, ModelConfig, load_config
from meshtron.models.init import initial_value, initialize
from meshtron.models.transformer import Transformer
from meshtron.optim.adamw import build_adamw
from meshtron.optim.data_parallel import DataParallelOptimizer
from meshtron.parallel.layout import MeshLayout
from meshtron.parallel.mesh import ParallelMesh
from meshtron.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TPRegion
from meshtron.precision.policy import Precision
from meshtron.training.step import train_step

TP = 2
TIMEOUT = 900  # seconds per process group
VARIANTS = ("meshtron", "dtensor", "dtensor-per-linear", "meshtron+sp", "dtensor+sp")


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 768
    vocab: int = 1024
    seq: int = 128
    batch: int = 4

    def config(self) -> Config:
        return load_config(overrides=[
            "--model.preset=tiny", f"--model.num_layers={self.layers}",
            f"--model.hidden_size={self.hidden}", f"--model.num_heads={self.heads}",
            f"--model.num_kv_heads={self.kv_heads}", f"--model.ffn_hidden_size={self.ffn}",
            f"--model.vocab_size={self.vocab}", f"--train.seq_len={self.seq}",
        ])


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS


# ----------------------------------------------------------------- the DTensor peer model


class Attention(nn.Module):
    def __init__(self, s: Shape):
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
    def __init__(self, s: Shape):
        super().__init__()
        self.w1 = nn.Linear(s.hidden, s.ffn, bias=False)  # gate
        self.w3 = nn.Linear(s.hidden, s.ffn, bias=False)  # up
        self.w2 = nn.Linear(s.ffn, s.hidden, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, s: Shape, eps: float):
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

    def __init__(self, s: Shape, eps: float, theta: float):
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


LAYER_SOURCES: dict[str, tuple[str, int | None]] = {
    "attention_norm.weight": ("attn_norm.weight", None),
    "ffn_norm.weight": ("mlp_norm.weight", None),
    "attention.wq.weight": ("attn.q.weight", None),
    "attention.wk.weight": ("attn.kv.weight", 0),
    "attention.wv.weight": ("attn.kv.weight", 1),
    "attention.wo.weight": ("attn.proj.weight", None),
    "feed_forward.w1.weight": ("mlp.gate_up.weight", 0),
    "feed_forward.w3.weight": ("mlp.gate_up.weight", 1),
    "feed_forward.w2.weight": ("mlp.down.weight", None),
}
TOP_SOURCES = {"tok_embeddings.weight": "embed.weight", "norm.weight": "final_norm.weight",
               "output.weight": "output.weight"}


def meshtron_source(name: str) -> tuple[str, int | None]:
    """The meshtron global parameter (and half of a fused [k|v] or [gate|up]) behind ``name``."""
    if name in TOP_SOURCES:
        return TOP_SOURCES[name], None
    _, i, rest = name.split(".", 2)
    source, half = LAYER_SOURCES[rest]
    return f"layers.{i}.{source}", half


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


# ------------------------------------------------------------------------------ variants


def _tokens(s: Shape) -> torch.Tensor:
    return torch.randint(0, s.vocab, (s.batch, s.seq + 1),
                         generator=torch.Generator().manual_seed(0))


def build_meshtron(rank: int, s: Shape, sp: bool) -> tuple[nn.Module, Callable[[], float]]:
    cfg = s.config()
    mesh = ParallelMesh(MeshLayout(TP, tp=TP), rank)
    model = Transformer(cfg.model, mesh, sequence_parallel=sp)
    initialize(model, seed=cfg.train.seed, std=cfg.model.init_std, num_layers=cfg.model.num_layers)
    model.train()
    optimizer = DataParallelOptimizer(model, mesh, cfg.train, zero=0,
                                      bucket_mb=cfg.parallel.bucket_mb)
    batch, precision = _tokens(s), Precision("fp32", torch.device("cpu"))

    def step() -> float:
        return train_step(model, optimizer, batch, mesh, global_tokens=s.batch * s.seq,
                          micro_batch=s.batch, lr=cfg.train.lr, grad_clip=cfg.train.grad_clip,
                          precision=precision).loss

    return model, step


def build_dtensor(rank: int, s: Shape, sp: bool,
                  per_linear: bool = False) -> tuple[nn.Module, Callable[[], float]]:
    cfg = s.config()
    m: ModelConfig = cfg.model
    mesh = init_device_mesh("cpu", (TP,))
    with torch.device("meta"):
        model = Llama(s, m.norm_eps, m.rope_theta)
    parallelize_llama(model, mesh, sp, per_linear)
    model.to_empty(device="cpu")
    model.init_rope()
    with torch.no_grad():
        for name, param in model.named_parameters():
            source, half = meshtron_source(name)
            full = initial_value(source, _meshtron_global_shape(source, m), seed=cfg.train.seed,
                                 std=m.init_std, num_layers=m.num_layers)
            if half is not None:
                full = full.chunk(2)[half]
            local = param.to_local() if isinstance(param, DTensor) else param
            if isinstance(param, DTensor):
                for placement in param.placements:
                    if isinstance(placement, Shard):
                        full = full.chunk(TP, dim=placement.dim)[rank]
            local.copy_(full)
    model.train()
    optimizer = build_adamw(model, cfg.train)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = _tokens(s)
    inputs, targets = batch[:, :-1], batch[:, 1:].reshape(-1)
    count = targets.numel()

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with loss_parallel():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets, reduction="sum") / count
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip, foreach=True)
        optimizer.step()
        loss = loss.detach()
        return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)

    return model, step


def _meshtron_global_shape(source: str, m: ModelConfig) -> tuple[int, ...]:
    h, d = m.hidden_size, m.hidden_size // m.num_heads
    suffix = source.split(".", 2)[-1] if source.startswith("layers.") else source
    return {
        "attn_norm.weight": (h,), "mlp_norm.weight": (h,), "final_norm.weight": (h,),
        "attn.q.weight": (m.num_heads * d, h), "attn.kv.weight": (2 * m.num_kv_heads * d, h),
        "attn.proj.weight": (h, m.num_heads * d), "mlp.gate_up.weight": (2 * m.ffn_hidden_size, h),
        "mlp.down.weight": (h, m.ffn_hidden_size), "embed.weight": (m.vocab_size, h),
        "output.weight": (m.vocab_size, h),
    }[suffix]


BUILDERS: dict[str, Callable[[int, Shape, bool], tuple[nn.Module, Callable[[], float]]]] = {
    "meshtron": build_meshtron, "dtensor": build_dtensor,
    "dtensor-per-linear": lambda rank, s, sp: build_dtensor(rank, s, sp, per_linear=True),
}


def build(variant: str, rank: int, s: Shape) -> tuple[nn.Module, Callable[[], float]]:
    kind, _, sp = variant.partition("+")
    return BUILDERS[kind](rank, s, sp == "sp")


# --------------------------------------------------------------------------------- tasks


def _timed(step: Callable[[], float]) -> tuple[float, float]:
    dist.barrier()  # both ranks start together, so a lagging peer is not charged to this step
    start = time.perf_counter()
    loss = step()
    return time.perf_counter() - start, loss


def steps_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """All variants in one process pair, steps interleaved with a rotating order."""
    s = Shape(**args["shape"])
    variants: list[str] = args["variants"]
    steps = {v: build(v, rank, s)[1] for v in variants}
    losses = {v: [_timed(steps[v])[1] for _ in range(args["warmup"])] for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(args["steps"]):
        k = i % len(variants)
        for v in variants[k:] + variants[:k]:
            times[v].append(_timed(steps[v])[0])
    return {"times": times, "first_loss": {v: x[0] for v, x in losses.items()},
            "last_warmup_loss": {v: x[-1] for v, x in losses.items()}}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the storage behind ``t``, through DTensor and pending-collective
    wrappers."""
    while hasattr(t, "_local_tensor") or hasattr(t, "elem"):  # DTensor, AsyncCollectiveTensor
        t = t._local_tensor if hasattr(t, "_local_tensor") else t.elem
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def saved_activation_bytes(model: nn.Module, step: Callable[[], float]) -> int:
    """Bytes of the distinct storages autograd saves for backward in one step (weights
    excluded): the activation memory, free of allocator noise."""
    weights = {_storage(p)[0] for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage(t)
        if ptr not in weights:
            saved[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(saved.values())


def memory_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One variant in a fresh process pair: peak RSS of building it and of training it."""
    s = Shape(**args["shape"])
    base_kb = _status_kb("VmRSS")
    model, step = build(args["variant"], rank, s)
    built_kb, build_peak_kb = _status_kb("VmRSS"), _status_kb("VmHWM")
    _reset_peak_rss()
    reset_kb = _status_kb("VmHWM")
    losses, times = [], []
    for i in range(args["warmup"] + args["steps"]):
        dt, loss = _timed(step)
        losses.append(loss)
        if i >= args["warmup"]:
            times.append(dt)
    train_peak_kb = _status_kb("VmHWM")
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return {"base_mb": base_kb / 1024, "built_mb": built_kb / 1024,
            "peak_mb": max(build_peak_kb, train_peak_kb) / 1024,
            "train_peak_mb": train_peak_kb / 1024,
            "train_rise_mb": (train_peak_kb - max(built_kb, reset_kb)) / 1024,
            "saved_activations_mb": saved_activation_bytes(model, step) / 2**20,
            "local_params": sum(p.numel() for p in local),
            "first_loss": losses[0], "times": times}


COMM_KEYS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
             "barrier", "wait_tensor", "broadcast", "c10d", "gloo")
KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product")


def _label_collectives() -> None:
    """Wrap the collectives meshtron calls in profiler ranges: gloo's ``work.wait()`` runs in
    Python after ``c10d::allreduce_`` returns, so without this the wait is charged to the
    calling autograd function (DTensor's waits show up as ``_c10d_functional::wait_tensor``)."""
    from torch.autograd.profiler import record_function

    import meshtron.parallel.collectives as collectives

    def labelled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            with record_function(f"meshtron.comm::{name}"):
                return fn(*a, **k)
        return call

    collectives._all_gather = labelled("all_gather", collectives._all_gather)
    collectives._reduce_scatter = labelled("reduce_scatter", collectives._reduce_scatter)
    collectives.dist.all_reduce = labelled("all_reduce", dist.all_reduce)  # type: ignore


def profile_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Where a step's time goes (rank 0): collectives (including waiting for the peer), matmul
    and attention kernels, other aten ops, and the rest (Python, autograd, DTensor dispatch)."""
    from torch.profiler import ProfilerActivity, profile

    _label_collectives()
    s = Shape(**args["shape"])
    n = args["steps"]
    out: dict[str, Any] = {}
    for variant in args["variants"]:
        _, step = build(variant, rank, s)
        for _ in range(args["warmup"]):
            _timed(step)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(n):
                step()
            wall = (time.perf_counter() - start) / n
        events = prof.key_averages()
        sums = {"comm": 0.0, "kernels": 0.0, "other_aten": 0.0}
        for e in events:
            self_s = e.self_cpu_time_total / 1e6 / n
            if any(k in e.key.lower() for k in COMM_KEYS):
                sums["comm"] += self_s
            elif e.key.startswith(KERNELS):
                sums["kernels"] += self_s
            elif e.key.startswith("aten::"):
                sums["other_aten"] += self_s
        out[variant] = {
            "wall_s": wall, **{f"{k}_s": v for k, v in sums.items()},
            "rest_s": wall - sum(sums.values()),
            "collective_calls": sum(e.count for e in events if e.key.startswith("c10d::")) // n,
            "top": [(e.key, e.self_cpu_time_total / 1e6 / n, e.count // n) for e in sorted(
                events, key=lambda e: -e.self_cpu_time_total)[:15]],
        }
    return out


def layers_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """meshtron's column -> row pair against megatron-core's, same weights and inputs."""
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed"
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as megatron_state
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel import layers as megatron_layers
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")

    b, s, h, ffn = args["batch"], args["seq"], args["hidden"], args["ffn"]
    gen = torch.Generator().manual_seed(1)
    w1 = torch.randn(ffn, h, generator=gen) * 0.02
    w2 = torch.randn(h, ffn, generator=gen) * 0.02
    x = torch.randn(b, s, h, generator=gen)
    grad_out = torch.randn(b, s, h, generator=gen)

    mesh = ParallelMesh(MeshLayout(TP, tp=TP), rank)
    region = TPRegion(mesh.tp)
    ours_col = ColumnParallelLinear(h, ffn, False, region)
    ours_row = RowParallelLinear(ffn, h, False, region)

    megatron_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    config = ModelParallelConfig(tensor_model_parallel_size=TP, use_cpu_initialization=True,
                                 perform_initialization=False, params_dtype=torch.float32)
    no_init: Callable[[torch.Tensor], None] = lambda _: None  # noqa: E731
    theirs_col = megatron_layers.ColumnParallelLinear(h, ffn, config=config, init_method=no_init,
                                                      bias=False, gather_output=False)
    theirs_row = megatron_layers.RowParallelLinear(ffn, h, config=config, init_method=no_init,
                                                   bias=False, input_is_parallel=True,
                                                   skip_bias_add=False)
    with torch.no_grad():
        for col, row in ((ours_col, ours_row), (theirs_col, theirs_row)):
            col.weight.copy_(w1.chunk(TP, dim=0)[rank])
            row.weight.copy_(w2.chunk(TP, dim=1)[rank])

    def ours() -> tuple[torch.Tensor, ...]:
        inp = x.clone().requires_grad_()
        ours_col.weight.grad = ours_row.weight.grad = None
        y = ours_row(ours_col(region.enter(inp)))
        y.backward(grad_out)
        return y.detach(), inp.grad, ours_col.weight.grad, ours_row.weight.grad

    def theirs() -> tuple[torch.Tensor, ...]:
        inp = x.clone().requires_grad_()
        theirs_col.weight.grad = theirs_row.weight.grad = None
        y, _ = theirs_row(theirs_col(inp)[0])
        y.backward(grad_out)
        return y.detach(), inp.grad, theirs_col.weight.grad, theirs_row.weight.grad

    names = ("output", "input grad", "column weight grad", "row weight grad")
    diffs = {n: float((a - c).abs().max()) for n, a, c in zip(names, ours(), theirs())}
    scale = {n: float(c.abs().max()) for n, c in zip(names, theirs())}
    funcs = {"meshtron": ours, "megatron": theirs}
    times: dict[str, list[float]] = {k: [] for k in funcs}
    for i in range(args["warmup"] + args["steps"]):
        for key in (("meshtron", "megatron") if i % 2 == 0 else ("megatron", "meshtron")):
            dist.barrier()
            start = time.perf_counter()
            funcs[key]()
            if i >= args["warmup"]:
                times[key].append(time.perf_counter() - start)
    return {"max_abs_diff": diffs, "max_abs_value": scale, "times": times,
            "sequence_parallel_error": _megatron_sp_error(megatron_layers, ModelParallelConfig,
                                                          x, rank, h, ffn)}


def _megatron_sp_error(layers: Any, config_type: Any, x: torch.Tensor, rank: int, h: int,
                       ffn: int) -> str | None:
    """Try megatron-core's sequence-parallel pair on CPU; the error it stops with, if any."""
    config = config_type(tensor_model_parallel_size=TP, use_cpu_initialization=True,
                         perform_initialization=False, params_dtype=torch.float32,
                         sequence_parallel=True)
    no_init: Callable[[torch.Tensor], None] = lambda _: None  # noqa: E731
    try:
        col = layers.ColumnParallelLinear(h, ffn, config=config, init_method=no_init, bias=False,
                                          gather_output=False)
        row = layers.RowParallelLinear(ffn, h, config=config, init_method=no_init, bias=False,
                                       input_is_parallel=True, skip_bias_add=False)
        for p in (*col.parameters(), *row.parameters()):
            torch.nn.init.normal_(p, std=0.02)
        inp = x.transpose(0, 1).chunk(TP, dim=0)[rank].contiguous().requires_grad_()
        y, _ = row(col(inp)[0])
        y.sum().backward()
    except Exception as err:  # noqa: BLE001 - this is the finding
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return None


# ---------------------------------------------------------------------------------- main


def machine() -> dict[str, Any]:
    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    return host_info(megatron_core=version("megatron-core"))


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _check_losses(first: dict[str, float], what: str) -> None:
    reference = first["meshtron"] if "meshtron" in first else next(iter(first.values()))
    for loss in first.values():
        if not math.isclose(loss, reference, rel_tol=1e-4):
            raise AssertionError(f"{what}: first losses differ: {first}")


def _sp(variant: str) -> bool:
    return variant.endswith("+sp")


EXACT_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc gives every block of 64 KiB or more its own mapping and unmaps it when freed, so the
process's high-water mark is the peak of live memory rather than of glibc's retained heap."""


def bench_steps(args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    common = {"shape": asdict(shape), "warmup": args.warmup}
    ranks = spawn(steps_task, TP, {**common, "variants": list(VARIANTS), "steps": args.steps},
                  timeout=TIMEOUT)
    _check_losses(ranks[0]["first_loss"], "interleaved run")
    _check_losses(ranks[0]["last_warmup_loss"], "interleaved run, last warm-up step")
    memory: dict[str, dict[str, list[dict[str, Any]]]] = {v: {} for v in VARIANTS}
    for allocator, env in (("default", {}), ("exact", EXACT_ALLOCATOR)):
        for variant in VARIANTS:  # meshtron and DTensor alternate
            memory[variant][allocator] = spawn(
                memory_task, TP, {**common, "variant": variant, "steps": args.memory_steps},
                timeout=TIMEOUT, env=env)
    _check_losses({v: m["default"][0]["first_loss"] for v, m in memory.items()}, "memory runs")
    times = {v: ranks[0]["times"][v] for v in VARIANTS}

    def per_variant(allocator: str, key: str) -> dict[str, float]:
        return {v: max(r[key] for r in memory[v][allocator]) for v in VARIANTS}

    metrics = {"s_per_step": {v: _median(t) for v, t in times.items()},
               "peak_rss_mb": per_variant("default", "peak_mb"),
               "exact_peak_rss_mb": per_variant("exact", "peak_mb"),
               "exact_train_rise_mb": per_variant("exact", "train_rise_mb"),
               "train_rise_mb": per_variant("default", "train_rise_mb"),
               "saved_activations_mb": per_variant("exact", "saved_activations_mb")}
    rows = []
    for variant in VARIANTS:
        peers = [v for v in VARIANTS if v.startswith("dtensor") and _sp(v) == _sp(variant)]
        row: dict[str, Any] = {"variant": variant}
        for name, values in metrics.items():
            best = min(peers, key=values.__getitem__)  # the strongest DTensor figure
            row[name] = values[variant]
            row[f"{name}_ratio"] = values[variant] / values[best]
            row[f"{name}_peer"] = best
        fastest = row["s_per_step_peer"]
        row.update({
            "s_per_step_rank1": _median(ranks[1]["times"][variant]),
            "paired_ratio_median": _median([a / b for a, b in zip(times[variant],
                                                                   times[fastest])]),
            "peak_rss_mb_per_rank": {a: [r["peak_mb"] for r in memory[variant][a]]
                                     for a in memory[variant]},
            "local_params": memory[variant]["default"][0]["local_params"],
            "first_loss": ranks[0]["first_loss"][variant],
            "last_warmup_loss": ranks[0]["last_warmup_loss"][variant], "times": times[variant],
        })
        rows.append(row)
    return {"rows": rows, "memory_runs": memory}


def print_steps(result: dict[str, Any], args: argparse.Namespace, shape: Shape) -> None:
    print(f"\ntraining step, tp=2 (fp32, AdamW, grad clip): {shape}")
    print(f"time: median of {args.steps} interleaved steps per variant (rank 0) after "
          f"{args.warmup} warm-up; memory: a fresh process pair per variant and allocator "
          f"({args.warmup}+{args.memory_steps} steps), larger rank. Each ratio is against the "
          "best DTensor plan for that column with the same SP setting.\n")
    print("| variant | s/step | ratio | pair ratio | peak RSS MB (rank 0 / 1) | ratio "
          "| peak RSS MB, exact allocator | ratio | training rise MB, exact | ratio "
          "| saved activations MB | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in result["rows"]:
        per_rank = " / ".join(f"{v:.0f}" for v in r["peak_rss_mb_per_rank"]["default"])
        print(f"| {r['variant']} | {r['s_per_step']:.3f} | {r['s_per_step_ratio']:.2f} | "
              f"{r['paired_ratio_median']:.2f} | {per_rank} | {r['peak_rss_mb_ratio']:.3f} | "
              f"{r['exact_peak_rss_mb']:.1f} | "
              f"{r['exact_peak_rss_mb_ratio']:.3f} | {r['exact_train_rise_mb']:.1f} | "
              f"{r['exact_train_rise_mb_ratio']:.2f} | {r['saved_activations_mb']:.1f} | "
              f"{r['saved_activations_mb_ratio']:.2f} |")
    params = {r["variant"]: r["local_params"] for r in result["rows"]}
    print(f"\nparameters per rank: {params}")


def bench_layers(args: argparse.Namespace) -> dict[str, Any]:
    dims = {"batch": 4, "seq": 128, "hidden": args.layer_hidden, "ffn": args.layer_ffn}
    ranks = spawn(layers_task, TP, {**dims, "warmup": 3, "steps": args.layer_steps},
                  timeout=TIMEOUT)
    worst = {k: max(r["max_abs_diff"][k] for r in ranks) for k in ranks[0]["max_abs_diff"]}
    med = {k: _median(v) for k, v in ranks[0]["times"].items()}
    return {**dims, "max_abs_diff": worst,
            "max_abs_value": ranks[0]["max_abs_value"], "median_s": med,
            "ratio": med["meshtron"] / med["megatron"],
            "pair_ratio": _median([a / b for a, b in zip(ranks[0]["times"]["meshtron"],
                                                          ranks[0]["times"]["megatron"])]),
            "times": ranks[0]["times"],
            "sequence_parallel_error": ranks[0]["sequence_parallel_error"]}


def print_layers(result: dict[str, Any]) -> None:
    print(f"\nlayer pair vs megatron-core, tp=2: x [{result['batch']}, {result['seq']}, "
          f"{result['hidden']}] -> column {result['hidden']}->{result['ffn']} -> row "
          f"{result['ffn']}->{result['hidden']}, forward+backward, fp32\n")
    print("| quantity | max abs diff (both ranks) | max abs value |")
    print("| --- | --- | --- |")
    for key, diff in result["max_abs_diff"].items():
        print(f"| {key} | {diff:.2e} | {result['max_abs_value'][key]:.3g} |")
    m = result["median_s"]
    print(f"\n| meshtron s/iter | megatron-core s/iter | ratio | pair ratio |\n"
          f"| --- | --- | --- | --- |\n| {m['meshtron']:.4f} | {m['megatron']:.4f} | "
          f"{result['ratio']:.3f} | {result['pair_ratio']:.3f} |")
    if result["sequence_parallel_error"]:
        print(f"\nmegatron-core with sequence_parallel=True on CPU: "
              f"{result['sequence_parallel_error']}")


def print_profile(result: dict[str, Any]) -> None:
    print("\nwhere a step goes (rank 0, torch.profiler self times, s/step, profiler overhead "
          "included)\n")
    print("| variant | wall | collectives incl. waits | collective calls | matmul + SDPA "
          "| other aten | Python, autograd, dispatch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for variant, p in result.items():
        print(f"| {variant} | {p['wall_s']:.3f} | {p['comm_s']:.3f} | {p['collective_calls']} "
              f"| {p['kernels_s']:.3f} | {p['other_aten_s']:.3f} | {p['rest_s']:.3f} |")
    for variant, p in result.items():
        print(f"\n{variant}: top self-CPU ops (s/step, calls/step)")
        for name, secs, calls in p["top"]:
            print(f"  {secs:8.4f}  {calls:5d}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20,
                        help="timed steps per variant in the interleaved run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=5,
                        help="timed steps in each fresh-process memory run")
    parser.add_argument("--layer-steps", type=int, default=20,
                        help="timed forward+backward iterations per layer pair")
    parser.add_argument("--layer-hidden", type=int, default=1024)
    parser.add_argument("--layer-ffn", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=Shape.layers, help="transformer layers")
    parser.add_argument("--vocab", type=int, default=Shape.vocab,
                        help="vocabulary (a multiple of 128: meshtron pads to one)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["steps", "layers"])
    parser.add_argument("--profile", action="store_true",
                        help="also profile a few steps of every variant")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args()
    if args.vocab % 128:
        parser.error("--vocab must be a multiple of 128 (meshtron pads the vocabulary to one)")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers
    shape = Shape(layers=args.layers, vocab=args.vocab)
    info = machine()
    print(f"{info['date']}  {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
          f"megatron-core {info['megatron_core']}, Python {info['python']}; "
          f"tp=2 on gloo, 1 thread per process; load average {info['load_average'][0]:.2f}")
    result: dict[str, Any] = {"machine": info, "command": " ".join(sys.argv),
                              "shape": asdict(shape)}
    if "steps" not in args.skip:
        result["train_step"] = bench_steps(args, shape)
        print_steps(result["train_step"], args, shape)
    if args.profile:
        result["profile"] = spawn(profile_task, TP, {"shape": asdict(shape), "warmup": 2,
                                                     "steps": 5, "variants": list(VARIANTS)},
                                  timeout=TIMEOUT)[0]
        print_profile(result["profile"])
    if "layers" not in args.skip:
        if importlib.util.find_spec("megatron") is None:
            print("\nmegatron-core layer comparison skipped: megatron-core is not installed "
                  "(pip install -e '.[bench]')")
            result["layers"] = {"error": "megatron-core is not installed"}
        else:
            result["layers"] = bench_layers(args)
            print_layers(result["layers"])
            worst = max(result["layers"]["max_abs_diff"].values())
            if worst > 1e-5:
                raise AssertionError(f"meshtron and megatron-core layers differ by {worst:.2e}")
    result["load_average_end"] = os.getloadavg()
    print(f"\nload average at the end: {result['load_average_end'][0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
