"""Mixture of experts on CPU: grouped vs looped expert compute, MoE vs dense, ep=2 vs ep=1.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/moe.py [--profile] [--json OUT]

``--quick`` is a smoke run (one small layer size, one short round of training, ~30 s);
``--sizes``, ``--tokens``, ``--reps``, ``--rounds``, ``--steps``, ``--skip``: see ``--help``.

**1. The MoE layer alone** (this process, one torch thread). For each size ``HxE`` (hidden H,
E experts; top-2, softmax router, dropless, no shared expert, SwiGLU experts of
``--expert-ffn`` x H hidden units) three modules run forward + backward on the same
``[1, --tokens, H]`` fp32 input and output gradient:

- ``grouped``: ``meshtron.models.moe.MoE(cfg.model, TPRegion(mesh.tp), mesh, shared=None, ...)``
  on ``ParallelMesh.single()`` with ``model.moe.compute=grouped`` (one ``torch._grouped_mm`` per
  projection);
- ``loop``: the same layer with ``model.moe.compute=loop`` (one matmul per expert, ``split`` /
  ``cat``);
- ``dense``: ``meshtron.models.blocks.MLP`` with ``ffn = top_k x expert ffn``: the same
  active expert parameters per token and the same GEMM FLOPs (the MoE adds its router).

All three are initialised by ``meshtron.models.init.initialize`` (seed 1234), so ``grouped`` and
``loop`` hold identical weights; their outputs and input gradients are compared (printed max
abs difference). The layers run in training mode with a loss weight of ``1 / tokens`` so the
balance loss's gradient is part of backward, as in a training step. Timing: 2 warm-up rounds,
then ``--reps`` rounds; in each round every module runs once, in an order that rotates every
round. Per module: median wall time (``perf_counter``) and median thread CPU time
(``thread_time``: insensitive to other jobs taking the cores while this one waits). Ratio =
ratio of medians; pair ratio = median over rounds of the ratio within the round.
``--profile`` adds ``torch.profiler`` self CPU times of the last size's modules: matrix
products (``aten::mm``: on CPU ``_grouped_mm`` runs one per expert) against everything else.

**2. Expert parallelism in training** (two gloo processes spawned by ``benchmarks/harness``, one
torch thread each). Both ranks run ``meshtron.training.trainer.Trainer`` on the ``tiny-moe`` preset
(llama, 4 layers, hidden 256, 8 heads / 4 kv heads, every layer MoE: 8 experts of 192 units, top-2,
1 shared expert) with a 512-token BPE tokenizer on a 0.3 MB slice of the default corpus (built once
in a temporary cache directory by the parent), seq 128, global batch 8 (4 sequences per rank), fp32
AdamW, at ``--parallel.ep=1`` (dp=2: every rank holds all 8 experts, their gradients are
all-reduced) and ``--parallel.ep=2`` (dp=2 folded into ep=2: 4 experts per rank, tokens dispatched
with ``all_to_all_single``, expert gradients not reduced). One process pair per round trains both
layouts one after the other (the order alternates between rounds). Step time = ``step_time_s`` from
rank 0's ``metrics.jsonl`` (``train.log_every=1``), the first ``--warmup`` steps of each run
skipped; s/step = median over all rounds. CPU s/step = process CPU time of each ``train_step`` call
(gloo's threads included), mean of the two ranks: less sensitive than wall time to other jobs, blind
to time spent waiting. Losses of the two layouts must agree to 1e-4 relative at every step (same
model, same data: layout independence; checked). Bytes are rank 0's ``comm_bytes`` per step; the
balanced-routing estimate of ``ep/all_to_all`` is 2 (dispatch, return) x 2 (forward, backward) x
local tokens x top-k x (ep - 1) / ep x H x 4 B x MoE layers.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import harness
import torch

# meshtron: imported where used, in layer_config, build_layers, train_layout and bench_ep only

SEED = 1234
TOP_K = 2
VARIANTS = ("grouped", "loop", "dense")
WORLD = 2
EP_SEQ = 128
EP_GLOBAL_BATCH = 8


# ---------------------------------------------------------------------------------- layer


@dataclass(frozen=True)
class Size:
    hidden: int
    experts: int

    @classmethod
    def parse(cls, text: str) -> Size:
        hidden, experts = text.lower().split("x")
        return cls(int(hidden), int(experts))

    def __str__(self) -> str:
        return f"{self.hidden}x{self.experts}"


def layer_config(size: Size, expert_ffn: int, compute: str) -> Any:
    """The model config of a standalone MoE layer (the preset only supplies defaults)."""
    from meshtron.config import load_config

    return load_config(overrides=[
        "--model.preset=tiny-moe", f"--model.hidden_size={size.hidden}",
        "--model.num_heads=8", "--model.num_kv_heads=8", "--model.vocab_size=1024",
        f"--model.moe.num_experts={size.experts}", f"--model.moe.top_k={TOP_K}",
        f"--model.moe.expert_ffn_size={expert_ffn}", "--model.moe.shared_experts=0",
        "--model.moe.capacity_factor=0", f"--model.moe.compute={compute}",
    ]).model


def build_layers(size: Size, expert_ffn: int, tokens: int) -> dict[str, torch.nn.Module]:
    """The three modules of one size, initialised from the same seed."""
    from meshtron.models.arch import architecture_of
    from meshtron.models.blocks import MLP
    from meshtron.models.init import initialize
    from meshtron.models.moe import MoE
    from meshtron.parallel.mesh import ParallelMesh
    from meshtron.parallel.tensor.layers import TPRegion
    from meshtron.parallel.tensor.linear import PLAIN

    mesh = ParallelMesh.single()
    region = TPRegion(mesh.tp)
    layers: dict[str, torch.nn.Module] = {}
    for variant in VARIANTS:
        cfg = layer_config(size, expert_ffn, "loop" if variant == "loop" else "grouped")
        arch = architecture_of(cfg)
        if variant == "dense":
            layer: torch.nn.Module = MLP(cfg, arch, region, PLAIN, ffn=TOP_K * expert_ffn)
        else:
            layer = MoE(cfg, region, mesh, shared=None, gated=arch.gated_mlp,
                        loss_weight=lambda: 1.0 / tokens)
        initialize(layer, seed=SEED, std=cfg.init_std, num_layers=cfg.num_layers)
        layers[variant] = layer.train()
    return layers


def forward_backward(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward + backward; the output and the input gradient."""
    for p in layer.parameters():
        p.grad = None
    inp = x.detach().requires_grad_()
    out = layer(inp)
    out.backward(grad)
    return out.detach(), inp.grad


def bench_layer(size: Size, expert_ffn: int, tokens: int, reps: int, warmup: int
                ) -> dict[str, Any]:
    """Time the three modules of one size, interleaved; compare grouped with loop."""
    ffn = expert_ffn * size.hidden
    layers = build_layers(size, ffn, tokens)
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(1, tokens, size.hidden, generator=gen)
    grad = torch.randn(1, tokens, size.hidden, generator=gen)
    (y_g, dx_g), (y_l, dx_l) = (forward_backward(layers[v], x, grad) for v in ("grouped", "loop"))
    for got, want, what in ((y_g, y_l, "output"), (dx_g, dx_l, "input gradient")):
        if float((got - want).abs().max()) > 1e-5 * float(want.abs().max()):
            raise AssertionError(f"{size}: grouped and loop {what}s differ")
    moe = layers["grouped"]
    load = moe.stats.load.clone()
    run = harness.interleave({v: functools.partial(forward_backward, layers[v], x, grad)
                              for v in VARIANTS}, reps, warmup=warmup, cpu=time.thread_time)
    active = {v: sum(p.numel() for n, p in layers[v].named_parameters()
                     if "experts" not in n) for v in VARIANTS}
    per_expert = sum(p.numel() for p in next(iter(moe.experts.values())).parameters())
    for v in ("grouped", "loop"):
        active[v] += TOP_K * per_expert
    return {
        "size": str(size), "hidden": size.hidden, "experts": size.experts, "expert_ffn": ffn,
        "dense_ffn": TOP_K * ffn, "tokens": tokens,
        "total_params": sum(p.numel() for p in moe.parameters()), "active_params": active,
        "load_max_over_mean": float(load.max() / load.mean()),
        "max_abs_diff": {"output": float((y_g - y_l).abs().max()),
                         "input_grad": float((dx_g - dx_l).abs().max())},
        "max_abs_value": {"output": float(y_l.abs().max()),
                          "input_grad": float(dx_l.abs().max())},
        "wall": run.wall, "cpu": run.cpu,
    }


def profile_layer(size: Size, expert_ffn: int, tokens: int, iters: int = 3) -> dict[str, Any]:
    """torch.profiler self CPU times per forward + backward of each module: matrix products
    (``aten::mm``, which CPU ``_grouped_mm`` calls once per expert) against the rest."""
    layers = build_layers(size, expert_ffn * size.hidden, tokens)
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(1, tokens, size.hidden, generator=gen)
    grad = torch.randn(1, tokens, size.hidden, generator=gen)
    out = {}
    for variant, layer in layers.items():
        forward_backward(layer, x, grad)
        with torch.profiler.profile() as prof:
            for _ in range(iters):
                forward_backward(layer, x, grad)
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        total = sum(e.self_cpu_time_total for e in events) / 1e6 / iters
        mm = sum(e.self_cpu_time_total for e in events if e.key == "aten::mm") / 1e6 / iters
        calls = sum(e.count for e in events if e.key == "aten::mm") // iters
        out[variant] = {"total_s": total, "mm_s": mm, "mm_calls": calls,
                        "top": harness.top_ops(events, iters, 8)}
    return out


def print_profile(size: Size, result: dict[str, Any]) -> None:
    """The profile table and each module's top operators."""
    print(f"\nwhere the time goes at {size} (torch.profiler self CPU s per forward + backward, "
          "profiler overhead included)\n")
    dense_rest = result["dense"]["total_s"] - result["dense"]["mm_s"]
    print(harness.markdown_table(
        ("module", "total", "aten::mm", "mm calls", "rest", "rest vs dense"),
        ((variant, f"{p['total_s']:.3f}", f"{p['mm_s']:.3f}", p["mm_calls"],
          f"{p['total_s'] - p['mm_s']:.3f}", f"+{p['total_s'] - p['mm_s'] - dense_rest:.3f}")
         for variant, p in result.items())))
    harness.print_top_ops(result, "per iteration")


def _ratios(times: dict[str, list[float]], a: str, b: str) -> tuple[float, float]:
    """Ratio of medians and pair ratio (median of per-round ratios), a / b."""
    return (harness.ratio_of_medians(times[a], times[b]),
            harness.pair_ratio(times[a], times[b]))


def print_layers(rows: list[dict[str, Any]], reps: int) -> None:
    """The layer table and the grouped-vs-loop differences."""
    print(f"\n1. MoE layer forward + backward, one process, 1 thread, fp32, top-{TOP_K}; "
          f"median of {reps} interleaved rounds (wall s; CPU = thread CPU time)\n")
    med = statistics.median

    def row(r: dict[str, Any]) -> tuple[object, ...]:
        w, c = r["wall"], r["cpu"]
        gl, gl_pair = _ratios(w, "grouped", "loop")
        gd, gd_pair = _ratios(w, "grouped", "dense")
        return (r["size"], r["tokens"], r["expert_ffn"], r["dense_ffn"],
                f"{r['total_params'] / 1e6:.2f}M / {r['active_params']['grouped'] / 1e6:.2f}M "
                f"({r['active_params']['dense'] / 1e6:.2f}M)", f"{med(w['grouped']):.3f}",
                f"{med(w['loop']):.3f}", f"{med(w['dense']):.3f}", f"**{gl:.2f}**",
                f"{gl_pair:.2f}", f"{_ratios(c, 'grouped', 'loop')[0]:.2f}", f"**{gd:.2f}**",
                f"{gd_pair:.2f}", f"{_ratios(c, 'grouped', 'dense')[0]:.2f}",
                f"{r['load_max_over_mean']:.2f}")

    print(harness.markdown_table(
        ("H x E", "tokens", "expert ffn", "dense ffn", "params total / active (dense)",
         "grouped s", "loop s", "dense s", "grouped / loop", "pair", "CPU ratio",
         "grouped / dense", "pair", "CPU ratio", "load max/mean"), map(row, rows)))
    print("\ngrouped vs loop, max abs difference (max abs value): " + "; ".join(
        f"{r['size']}: output {r['max_abs_diff']['output']:.1e} "
        f"({r['max_abs_value']['output']:.2g}), input grad {r['max_abs_diff']['input_grad']:.1e} "
        f"({r['max_abs_value']['input_grad']:.2g})" for r in rows))


# ---------------------------------------------------------------------------------- ep


def ep_overrides(cache_dir: str, run_dir: str, steps: int, ep: int) -> list[str]:
    """tiny-moe on a 0.3 MB slice of the default corpus, no downloads (as tests/parity.py)."""
    return [
        "--model.preset=tiny-moe", "--data.vocab_size=512", "--data.corpus_max_mb=0.3",
        f"--data.cache_dir={cache_dir}", f"--train.seq_len={EP_SEQ}",
        f"--train.global_batch={EP_GLOBAL_BATCH}", f"--train.steps={steps}",
        "--train.warmup_steps=2", "--train.eval_every=0", "--train.log_every=1",
        "--run.progress=false", "--run.plot=false", "--checkpoint.resume=false",
        f"--run.dir={run_dir}", f"--parallel.ep={ep}",
    ]


def train_layout(rank: int, overrides: list[str]) -> dict[str, Any]:
    """One Trainer run on this rank; losses, and on rank 0 the metrics rows."""
    from meshtron.config import load_config
    from meshtron.parallel.mesh import MeshLayout, ParallelMesh
    from meshtron.training import trainer as trainer_module
    from meshtron.training.trainer import Trainer

    cfg = load_config(overrides=overrides)
    p = cfg.parallel
    mesh = ParallelMesh(MeshLayout.of(p, WORLD), rank)
    trainer = Trainer(cfg, mesh, log=lambda m: None)
    params = sum(q.numel() for q in trainer.model.parameters())
    cpu_times: list[float] = []
    step = trainer_module.train_step

    def timed_step(*a: Any, **k: Any) -> Any:
        start = time.process_time()
        out = step(*a, **k)
        cpu_times.append(time.process_time() - start)
        return out

    trainer_module.train_step = timed_step  # the trainer looks it up at every step
    try:
        result = trainer.run()
    finally:
        trainer_module.train_step = step
    rows = []
    if rank == 0:
        path = result.run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"losses": result.losses, "rows": rows, "params": params, "cpu_times": cpu_times}


def ep_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Worker body: train each layout of ``args["order"]`` in turn; results by ep."""
    out = {}
    for ep in args["order"]:
        run_dir = f"{args['root']}/round{args['round']}-ep{ep}"
        out[ep] = train_layout(rank, ep_overrides(args["cache"], run_dir, args["steps"], ep))
    return out


def bench_ep(args: Any) -> dict[str, Any]:
    """``--rounds`` process pairs, each training ep=1 and ep=2 (order alternating)."""
    from meshtron.config import load_config
    from meshtron.data import build_training_data

    steps = args.warmup + args.steps
    times: dict[int, list[float]] = {1: [], 2: []}
    cpu: dict[int, list[float]] = {1: [], 2: []}
    params: dict[int, list[int]] = {}
    comm: dict[int, list[dict[str, int]]] = {1: [], 2: []}
    losses: dict[int, list[list[float]]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as root:
        cache = f"{root}/cache"
        cfg = load_config(overrides=ep_overrides(cache, f"{root}/unused", steps, 1))
        build_training_data(cfg.data, cfg.train.seq_len, cfg.train.seed, log=lambda m: None)
        for r in range(args.rounds):
            order = harness.rotated([1, 2], r)
            ranks = harness.spawn(ep_task, WORLD, {"order": order, "round": r, "root": root,
                                           "cache": cache, "steps": steps},
                          timeout=args.timeout)
            for ep in order:
                rows = ranks[0][ep]["rows"]
                assert len(rows) == steps, f"ep={ep}: {len(rows)} metrics rows, expected {steps}"
                times[ep] += [row["step_time_s"] for row in rows[args.warmup:]]
                cpu[ep] += harness.across_ranks((rank[ep]["cpu_times"][args.warmup:]
                                                 for rank in ranks), statistics.mean)
                params[ep] = [rank[ep]["params"] for rank in ranks]
                comm[ep] += [row["comm_bytes"] for row in rows[args.warmup:]]
                losses[ep].append(ranks[0][ep]["losses"])
    worst = max(abs(a - b) / abs(a) for l1, l2 in zip(losses[1], losses[2])
                for a, b in zip(l1, l2))
    if worst > 1e-4:
        raise AssertionError(f"ep=2 losses differ from ep=1 by {worst:.2e} relative: {losses}")
    moe = cfg.model.moe
    local_tokens = EP_GLOBAL_BATCH // WORLD * EP_SEQ
    estimate = (2 * 2 * local_tokens * moe.top_k * (WORLD - 1) / WORLD * cfg.model.hidden_size
                * 4 * sum(cfg.model.is_moe_layer(i) for i in range(cfg.model.num_layers)))
    keys = sorted({k for ep in comm for step in comm[ep] for k in step})
    return {"times": times, "cpu_times": cpu, "params_per_rank": params,
            "losses": losses, "max_rel_loss_diff": worst,
            "comm_bytes_median": {ep: {k: statistics.median(s.get(k, 0) for s in comm[ep])
                                       for k in keys} for ep in comm},
            "all_to_all_estimate": estimate, "local_tokens": local_tokens}


def _size(nbytes: float) -> str:
    """Bytes in B, KiB or MiB."""
    if nbytes >= 2**18:
        return f"{nbytes / 2**20:.2f} MiB"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes >= 2**10 else f"{nbytes:.0f} B"


def print_ep(result: dict[str, Any], args: Any) -> None:
    """The training-step table."""
    t = result["times"]
    med = {ep: statistics.median(v) for ep, v in t.items()}
    print(f"\n2. Training step, tiny-moe, 2 gloo processes (dp=2), 1 thread each, seq {EP_SEQ}, "
          f"global batch {EP_GLOBAL_BATCH}; median of {len(t[1])} steps ({args.rounds} rounds "
          f"x {args.steps}, after {args.warmup} warm-up steps per run); CPU = process CPU "
          "time of train_step, mean of the ranks\n")
    cpu = {ep: statistics.median(v) for ep, v in result["cpu_times"].items()}

    def row(ep: int) -> tuple[object, ...]:
        rounds = [statistics.median(t[ep][i:i + args.steps])
                  for i in range(0, len(t[ep]), args.steps)]
        return (f"ep={ep}", " / ".join(f"{n / 1e6:.2f}M" for n in result["params_per_rank"][ep]),
                f"{med[ep]:.3f}", f"**{med[ep] / med[1]:.2f}**",
                ", ".join(f"{x:.3f}" for x in rounds), f"{cpu[ep]:.3f}",
                f"{cpu[ep] / cpu[1]:.2f}", ", ".join(
                    f"{k} {_size(v)}" for k, v in result["comm_bytes_median"][ep].items() if v))

    print(harness.markdown_table(
        ("layout", "params per rank", "s/step", "ratio", "per-round medians", "CPU s/step",
         "CPU ratio", "sent per step (rank 0)"), map(row, (1, 2))))
    print(f"\nep/all_to_all estimate for balanced routing: "
          f"{_size(result['all_to_all_estimate'])} per step; losses ep=2 vs ep=1: "
          f"max relative difference {result['max_rel_loss_diff']:.1e} over "
          f"{sum(len(x) for x in result['losses'][1])} steps")


# ---------------------------------------------------------------------------------- main


def main() -> None:
    """Parse the flags, run the parts, print the tables."""
    cli = harness.cli
    parser = cli.parser(
        __doc__, cli.steps(10, "timed training steps per run"),
        cli.warmup(3, "skipped training steps per run"),
        cli.rounds(3, "process pairs for ep=1 vs ep=2"), cli.timeout(300.0, "per process pair, s"),
        cli.switch("--profile", "also profile the modules of the last size"),
        cli.switch("--quick", "smoke run: one small size, few repetitions, one round"))
    parser.add_argument("--sizes", nargs="+", type=Size.parse,
                        default=[Size.parse(s) for s in ("256x8", "256x32", "512x8", "512x32")],
                        help="layer sizes HIDDENxEXPERTS")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per layer call")
    parser.add_argument("--expert-ffn", type=int, default=1,
                        help="expert hidden units as a multiple of the hidden size")
    parser.add_argument("--reps", type=int, default=7, help="timed rounds per layer size")
    parser.add_argument("--skip", nargs="*", default=[], choices=["layer", "ep"])
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.tokens, args.reps = [Size(256, 8)], 1024, 3
        args.rounds, args.steps, args.warmup = 1, 3, 2
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers
    torch.set_num_threads(1)
    info = harness.host_info(grouped_mm=hasattr(torch, "_grouped_mm"))
    print(harness.host_line(info, f"torch._grouped_mm: {info['grouped_mm']}"))
    result = harness.record(info)
    started = time.perf_counter()
    if "layer" not in args.skip:
        result["layer"] = [bench_layer(s, args.expert_ffn, args.tokens, args.reps, 2)
                           for s in args.sizes]
        print_layers(result["layer"], args.reps)
        if args.profile:
            size = args.sizes[-1]
            result["profile"] = profile_layer(size, args.expert_ffn, args.tokens)
            print_profile(size, result["profile"])
    if "ep" not in args.skip:
        result["ep"] = bench_ep(args)
        print_ep(result["ep"], args)
    result["load_average_end"] = os.getloadavg()
    result["seconds"] = time.perf_counter() - started
    print(f"\nload average at the end: {result['load_average_end'][0]:.2f}; "
          f"{result['seconds']:.0f} s")
    harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
