"""Tensor parallelism (tp=2, gloo, CPU): meshtron against PyTorch DTensor and megatron-core.

Run from the repository root::

    .venv/bin/python benchmarks/tensor_parallel.py [--steps N] [--json OUT] [--profile]

Every measurement runs in two spawned gloo processes (``benchmarks/harness``; one torch thread
and ``OMP_NUM_THREADS=1`` each); the parent only launches them and prints. The training-step
workers all import the same modules (meshtron and DTensor's tensor-parallel API), so their
baseline memory is the same; only the layer workers import megatron-core (about 5 s and 100 MB).

1. **Training step** of a small llama (``--layers`` 4, hidden 256, 8 heads, 4 kv heads, SwiGLU
   768, ``--vocab`` 1024, sequence 128, micro-batch 4; fp32), tp=2, five variants:

   ``meshtron`` / ``meshtron+sp``
       ``meshtron.models.transformer.Transformer`` built from the run plan of ``tp=2`` (and
       ``sp``) on ``ParallelMesh(plan.layout, rank)``, trained by
       ``meshtron.training.step.train_step`` (forward,
       vocab-parallel loss sum / tokens, backward, gradient sync, global grad norm, clip to
       ``train.grad_clip``, AdamW through ``build_optimizer`` with zero 0).
   ``dtensor`` / ``dtensor+sp`` / ``dtensor-per-linear``
       the same network written as a plain single-device module (``peers/dtensor_llama.py``:
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
   its own mapping, returned when freed, so the high-water mark follows live memory). Peak RSS
   is the high-water mark of the process's own address space (``VmHWM``, not ``ru_maxrss``,
   which in a spawned child starts from the launcher's peak: ``benchmarks/harness/memory.py``).
   "Training rise" is the rise
   of the peak during training (the mark is reset through ``/proc/self/clear_refs`` once the
   model is built): activations, gradients, optimizer state, communication buffers. "Saved
   activations" is exact: the bytes of the distinct storages autograd saves for backward in
   one step (``saved_tensors_hooks``; weights excluded). Memory ratios are against the DTensor
   plan with the lowest figure in that column and the same SP setting.

   ``--profile`` adds a ``torch.profiler`` breakdown of a few steps per variant (rank 0):
   self time in collectives including waiting for the peer, in matmul and SDPA kernels, in
   other aten ops, and the rest (Python, autograd engine, DTensor dispatch).

2. **Layer pair against megatron-core** (``tensor_parallel_layers.py``; when megatron-core is
   installed: ``pip install -e '.[bench]'``):
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

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import harness
import tensor_parallel_layers
import torch
import torch.distributed as dist
import torch.nn.functional as F
from peers.dtensor_llama import Llama, LlamaShape, parallelize_llama
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

# meshtron: used in the "variants" section only (and _label_collectives wraps its collectives)
from meshtron.config import Config, ModelConfig, load_config
from meshtron.models.init import initial_value
from meshtron.optim.adamw import build_adamw
from meshtron.parallel.mesh import ParallelMesh
from meshtron.plan import plan_run
from meshtron.rank import build_rank
from meshtron.training.step import train_step

TP = 2
TIMEOUT = 900  # seconds per process group
VARIANTS = ("meshtron", "dtensor", "dtensor-per-linear", "meshtron+sp", "dtensor+sp")


@dataclass(frozen=True)
class Shape(LlamaShape):
    batch: int = 4

    def config(self, *extra: str) -> Config:
        """The model and one step's batch (``batch`` sequences, one micro-batch)."""
        return load_config(overrides=[
            "--model.preset=tiny", f"--model.num_layers={self.layers}",
            f"--model.hidden_size={self.hidden}", f"--model.num_heads={self.heads}",
            f"--model.num_kv_heads={self.kv_heads}", f"--model.ffn_hidden_size={self.ffn}",
            f"--model.vocab_size={self.vocab}", f"--train.seq_len={self.seq}",
            f"--train.global_batch={self.batch}", *extra,
        ])


# ------------------------------------------------------------------------------ variants


def _tokens(s: Shape) -> torch.Tensor:
    return torch.randint(0, s.vocab, (s.batch, s.seq + 1),
                         generator=torch.Generator().manual_seed(0))


def build_meshtron(rank: int, s: Shape, sp: bool, tp: int = TP,
                   *extra: str) -> tuple[nn.Module, Callable[[], float]]:
    """meshtron's model and step on ``tp`` ranks (``extra``: more config overrides)."""
    plan = plan_run(s.config(f"--parallel.tp={tp}", f"--parallel.sp={sp}", *extra), tp)
    parts, batch = build_rank(plan, ParallelMesh(plan.layout, rank)), _tokens(s)

    def step() -> float:
        return train_step(parts, batch, plan.config.train.lr).loss

    return parts.model, step


def build_dtensor(rank: int, s: Shape, sp: bool, per_linear: bool = False,
                  tp: int = TP) -> tuple[nn.Module, Callable[[], float]]:
    """The same network split by DTensor's tensor-parallel plan on ``tp`` ranks."""
    cfg = s.config()
    m: ModelConfig = cfg.model
    mesh = init_device_mesh("cpu", (tp,))
    with torch.device("meta"):
        model = Llama(s, m.norm_eps, m.rope_theta)
    parallelize_llama(model, mesh, sp, per_linear)
    model.to_empty(device="cpu")
    model.init_rope()
    with torch.no_grad():
        for name, param in model.named_parameters():
            source, half = meshtron_source(name)
            full = initial_value(source, meshtron_shape(source, m), seed=cfg.train.seed,
                                 std=m.init_std, num_layers=m.num_layers)
            if half is not None:
                full = full.chunk(2)[half]
            local = param.to_local() if isinstance(param, DTensor) else param
            if isinstance(param, DTensor):
                for placement in param.placements:
                    if isinstance(placement, Shard):
                        full = full.chunk(tp, dim=placement.dim)[rank]
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


def meshtron_shape(source: str, m: ModelConfig) -> tuple[int, ...]:
    """The global shape of meshtron parameter ``source``."""
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


# ------------------------------------------------------------------------------- profiling


COMM_KEYS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
             "barrier", "wait_tensor", "broadcast", "c10d", "gloo")
KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product")


def _label_collectives() -> None:
    """Wrap the collectives meshtron calls in profiler ranges: gloo's ``work.wait()`` runs in
    Python after ``c10d::allreduce_`` returns, so without this the wait is charged to the
    calling autograd function (DTensor's waits show up as ``_c10d_functional::wait_tensor``)."""
    from torch.autograd.profiler import record_function

    import meshtron.parallel.tensor.collectives as collectives

    def labelled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            with record_function(f"meshtron.comm::{name}"):
                return fn(*a, **k)
        return call

    collectives._all_gather = labelled("all_gather", collectives._all_gather)
    collectives._reduce_scatter = labelled("reduce_scatter", collectives._reduce_scatter)
    collectives.dist.all_reduce = labelled("all_reduce", dist.all_reduce)  # type: ignore


# --------------------------------------------------------------------------------- tasks


def steps_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """All variants in one process pair, steps interleaved with a rotating order."""
    s = Shape(**args["shape"])
    variants: list[str] = args["variants"]
    steps = {v: build(v, rank, s)[1] for v in variants}
    losses = {v: [harness.timed(steps[v], barrier=dist.barrier).value
                  for _ in range(args["warmup"])] for v in variants}
    run = harness.interleave(steps, args["steps"], barrier=dist.barrier)
    return {"times": run.wall, "first_loss": {v: x[0] for v, x in losses.items()},
            "last_warmup_loss": {v: x[-1] for v, x in losses.items()}}


def memory_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One variant in a fresh process pair: peak RSS of building it and of training it."""
    s = Shape(**args["shape"])
    base = harness.vm_status()["VmRSS"]
    model, step = build(args["variant"], rank, s)
    built = harness.vm_status()
    if not harness.reset_peak_rss():
        raise OSError("cannot reset VmHWM through /proc/self/clear_refs")
    reset = harness.vm_status()["VmHWM"]
    run = harness.interleave({"step": step}, args["steps"], warmup=args["warmup"],
                             barrier=dist.barrier)
    train_peak = harness.vm_status()["VmHWM"]
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    mib = 2**20
    return {"base_mb": base / mib, "built_mb": built["VmRSS"] / mib,
            "peak_mb": max(built["VmHWM"], train_peak) / mib, "train_peak_mb": train_peak / mib,
            "train_rise_mb": (train_peak - max(built["VmRSS"], reset)) / mib,
            "saved_activations_mb": harness.saved_activation_bytes(model, step) / mib,
            "local_params": sum(p.numel() for p in local),
            "first_loss": run.first["step"], "times": run.wall["step"]}


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
            harness.timed(step, barrier=dist.barrier)
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
            "top": harness.top_ops(events, n, 15),
        }
    return out


# ---------------------------------------------------------------------------------- main


def _sp(variant: str) -> bool:
    return variant.endswith("+sp")


def _check_losses(losses: dict[str, float], what: str) -> None:
    harness.check_close(losses, f"{what}: losses", reference="meshtron")


def bench_steps(args: Any, shape: Shape) -> dict[str, Any]:
    common = {"shape": asdict(shape), "warmup": args.warmup}
    ranks = harness.spawn(steps_task, TP, {**common, "variants": list(VARIANTS),
                                           "steps": args.steps}, timeout=TIMEOUT)
    _check_losses(ranks[0]["first_loss"], "interleaved run")
    _check_losses(ranks[0]["last_warmup_loss"], "interleaved run, last warm-up step")
    memory: dict[str, dict[str, list[dict[str, Any]]]] = {v: {} for v in VARIANTS}
    for allocator, env in (("default", {}), ("exact", harness.EXACT_ALLOCATOR)):
        for variant in VARIANTS:  # meshtron and DTensor alternate
            memory[variant][allocator] = harness.spawn(
                memory_task, TP, {**common, "variant": variant, "steps": args.memory_steps},
                timeout=TIMEOUT, env=env)
    _check_losses({v: m["default"][0]["first_loss"] for v, m in memory.items()}, "memory runs")
    times = {v: ranks[0]["times"][v] for v in VARIANTS}

    def per_variant(allocator: str, key: str) -> dict[str, float]:
        return {v: max(r[key] for r in memory[v][allocator]) for v in VARIANTS}

    metrics = {"s_per_step": {v: statistics.median(t) for v, t in times.items()},
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
        row.update({
            "s_per_step_rank1": statistics.median(ranks[1]["times"][variant]),
            "paired_ratio_median": harness.pair_ratio(times[variant],
                                                      times[row["s_per_step_peer"]]),
            "peak_rss_mb_per_rank": {a: [r["peak_mb"] for r in memory[variant][a]]
                                     for a in memory[variant]},
            "local_params": memory[variant]["default"][0]["local_params"],
            "first_loss": ranks[0]["first_loss"][variant],
            "last_warmup_loss": ranks[0]["last_warmup_loss"][variant], "times": times[variant],
        })
        rows.append(row)
    return {"rows": rows, "memory_runs": memory}


def print_steps(result: dict[str, Any], args: Any, shape: Shape) -> None:
    print(f"\ntraining step, tp=2 (fp32, AdamW, grad clip): {shape}")
    print(f"time: median of {args.steps} interleaved steps per variant (rank 0) after "
          f"{args.warmup} warm-up; memory: a fresh process pair per variant and allocator "
          f"({args.warmup}+{args.memory_steps} steps), larger rank. Each ratio is against the "
          "best DTensor plan for that column with the same SP setting.\n")
    print(harness.markdown_table(
        ("variant", "s/step", "ratio", "pair ratio", "peak RSS MB (rank 0 / 1)", "ratio",
         "peak RSS MB, exact allocator", "ratio", "training rise MB, exact", "ratio",
         "saved activations MB", "ratio"),
        ((r["variant"], f"{r['s_per_step']:.3f}", f"{r['s_per_step_ratio']:.2f}",
          f"{r['paired_ratio_median']:.2f}",
          " / ".join(f"{v:.0f}" for v in r["peak_rss_mb_per_rank"]["default"]),
          f"{r['peak_rss_mb_ratio']:.3f}", f"{r['exact_peak_rss_mb']:.1f}",
          f"{r['exact_peak_rss_mb_ratio']:.3f}", f"{r['exact_train_rise_mb']:.1f}",
          f"{r['exact_train_rise_mb_ratio']:.2f}", f"{r['saved_activations_mb']:.1f}",
          f"{r['saved_activations_mb_ratio']:.2f}") for r in result["rows"])))
    params = {r["variant"]: r["local_params"] for r in result["rows"]}
    print(f"\nparameters per rank: {params}")


def print_profile(result: dict[str, Any]) -> None:
    print("\nwhere a step goes (rank 0, torch.profiler self times, s/step, profiler overhead "
          "included)\n")
    print(harness.markdown_table(
        ("variant", "wall", "collectives incl. waits", "collective calls", "matmul + SDPA",
         "other aten", "Python, autograd, dispatch"),
        ((variant, f"{p['wall_s']:.3f}", f"{p['comm_s']:.3f}", p["collective_calls"],
          f"{p['kernels_s']:.3f}", f"{p['other_aten_s']:.3f}", f"{p['rest_s']:.3f}")
         for variant, p in result.items())))
    harness.print_top_ops(result, "per step")


def main() -> None:
    cli = harness.cli
    parser = cli.parser(__doc__, cli.steps(20, "timed steps per variant in the interleaved run"),
                        cli.warmup(3), cli.switch("--profile", "also profile a few steps of "
                                                               "every variant"))
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
    args = parser.parse_args()
    if args.vocab % 128:
        parser.error("--vocab must be a multiple of 128 (meshtron pads the vocabulary to one)")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers
    shape = Shape(layers=args.layers, vocab=args.vocab)
    info = harness.host_info(megatron_core=harness.package_version("megatron-core"))
    print(harness.host_line(info, f"megatron-core {info['megatron_core']}",
                            "tp=2 on gloo, 1 thread per process"))
    result = harness.record(info, shape=asdict(shape))
    if "steps" not in args.skip:
        result["train_step"] = bench_steps(args, shape)
        print_steps(result["train_step"], args, shape)
    if args.profile:
        result["profile"] = harness.spawn(profile_task, TP, {
            "shape": asdict(shape), "warmup": 2, "steps": 5, "variants": list(VARIANTS)},
            timeout=TIMEOUT)[0]
        print_profile(result["profile"])
    if "layers" not in args.skip:
        result["layers"] = tensor_parallel_layers.run(args.layer_hidden, args.layer_ffn,
                                                      args.layer_steps, TIMEOUT)
    result["load_average_end"] = os.getloadavg()
    print(f"\nload average at the end: {result['load_average_end'][0]:.2f}")
    harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
