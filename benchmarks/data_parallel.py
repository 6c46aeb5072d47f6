"""Data parallelism and ZeRO at dp=2 on gloo (CPU): meshtron against DDP, FSDP2 and DeepSpeed.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/data_parallel.py [--steps N] [--json OUT]

(``--rounds``, ``--memory-rounds``, ``--configs NAME ...``, ``--bucket-mb``: see ``--help``.)

DeepSpeed comes from the ``bench`` extra; on CPU install it with
``DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed`` next to the CPU torch (it
JIT-builds a small shared-memory op with the system compiler on first import).

**What runs.** Every configuration trains the same model, meshtron's ``Transformer`` of the
``tiny`` preset shape (llama: 4 layers, hidden 256, 8 heads / 4 kv heads, ffn 768, vocab 4096,
untied output; 5.2M parameters), seq 128, micro-batch 4 per rank, fp32, on two spawned gloo
processes with one torch thread each. Weights come from meshtron's seeded ``initialize``, so
every configuration starts from the same weights; step ``i`` uses the same random global batch
(8 rows) everywhere, each rank taking its 4 rows. The optimizer is AdamW with meshtron's
parameter groups and training defaults (lr 3e-3 constant, betas 0.9/0.95, weight decay 0.1 on
matrices only) and gradient clipping at 1.0:

- ``meshtron zero=Z``: ``build_optimizer(model, mesh, cfg.train, zero=Z,
  bucket_mb=--bucket-mb)`` and ``train_step`` (fp32 ``Precision``), ``mesh =
  ParallelMesh(plan.layout, rank)`` from the run plan (dp=2). Stage 0 updates with
  ``torch.optim.AdamW(foreach=True)``, stages 1-3 with meshtron's ``ShardedAdamW``.
- ``DDP``: ``torch.nn.parallel.DistributedDataParallel`` around a one-process-mesh
  ``Transformer`` (``bucket_cap_mb`` = ``--bucket-mb``), ``torch.optim.AdamW(foreach=True)``
  (``build_adamw``), ``clip_grad_norm_``.
- ``FSDP2``: ``torch.distributed.fsdp.fully_shard`` on each transformer block, then on the root
  (defaults: ``reshard_after_forward=True`` for blocks; FSDP2 keeps the root gathered between
  forward and backward), ``build_adamw`` over the DTensor parameters, ``clip_grad_norm_``.
- ``DeepSpeed ZeRO-Z``: ``deepspeed.initialize(model=..., optimizer=build_adamw(...),
  config={zero_optimization.stage: Z, gradient_clipping: 1.0, ...})`` over the same gloo
  process group. DeepSpeed's own Adam kernels (FusedAdam, DeepSpeedCPUAdam) are compiled ops,
  so the client optimizer is ``torch.optim.AdamW(foreach=True)`` wrapped by DeepSpeed's ZeRO
  optimizer (``zero_allow_untested_optimizer``); bucket sizes are DeepSpeed's defaults.

Peers average gradients over ranks, so their loss is the local mean (sum / 512 tokens);
meshtron sums gradients of sum / 1024 tokens. The gradients are the same, and the first
step's loss must agree to 1e-5 across all configurations (checked).

**How it is timed.** Each configuration runs in fresh processes: ``--warmup`` steps, then
``--steps`` timed steps, each after a barrier; a step's time is the slower rank's wall time of
the whole step (zero grad, forward, loss, backward, reduction, clip, update). ``--rounds``
rounds run every configuration in turn (the order rotating each round: ``benchmarks/harness``).
s/step = median over all timed steps of all rounds;
ratio = meshtron / peer of those medians; round ratio = median over rounds of the ratio of the
two configurations' per-round medians (runs close in time). CPU s/step is the process CPU time
of a step (``time.process_time``: every thread, gloo's included), mean of the two ranks: less
sensitive than wall time to other jobs taking the cores, blind to time spent waiting.

**How memory is measured** (per rank, from ``/proc/self/status``, in MiB):

- *base*: VmRSS after ``import torch`` (and ``torch._dynamo``, which ``torch.optim`` and
  DeepSpeed import), ``deepspeed`` for its runs, and joining the process group; before the
  model exists;
- *peak - base*: the peak RSS during the timed steps (VmHWM, reset with
  ``/proc/self/clear_refs`` after warm-up) minus *base*: parameters, gradients, optimizer
  state, activations and temporaries, plus whatever the allocator keeps mapped. The largest
  rank, median over rounds. ``ru_maxrss`` (the whole-process peak including start-up and model
  creation) is printed for reference.
- *(mmap)*: the same, from ``--memory-rounds`` extra runs (3 timed steps) with
  ``MALLOC_MMAP_THRESHOLD_=65536`` (``harness.EXACT_ALLOCATOR``: RSS follows the live tensors
  instead of glibc's heap high-water mark, which with the default dynamic threshold mostly
  measures fragmentation). Steps are slower there; only the memory of those runs is used.

Beside it, meshtron's own accounting ``optimizer.memory_bytes()`` (parameters, gradients,
optimizer state kept between steps) is printed with the formula of docs/parallelism.md.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import harness

WORLD = 2
MICRO_BATCH = 4
SEQ = 128
OVERRIDES = ("--model.preset=tiny", "--model.vocab_size=4096", f"--train.seq_len={SEQ}",
             f"--train.global_batch={WORLD * MICRO_BATCH}", f"--train.micro_batch={MICRO_BATCH}")


@dataclass(frozen=True)
class Setup:
    name: str
    family: str
    """meshtron, ddp, fsdp2 or deepspeed."""
    zero: int


SETUPS = {s.name: s for s in (
    Setup("meshtron zero=0", "meshtron", 0),
    Setup("DDP", "ddp", 0),
    Setup("meshtron zero=1", "meshtron", 1),
    Setup("DeepSpeed ZeRO-1", "deepspeed", 1),
    Setup("meshtron zero=2", "meshtron", 2),
    Setup("DeepSpeed ZeRO-2", "deepspeed", 2),
    Setup("meshtron zero=3", "meshtron", 3),
    Setup("FSDP2", "fsdp2", 3),
    Setup("DeepSpeed ZeRO-3", "deepspeed", 3),
)}
PAIRS = [("meshtron zero=0", "DDP"), ("meshtron zero=1", "DeepSpeed ZeRO-1"),
         ("meshtron zero=2", "DeepSpeed ZeRO-2"), ("meshtron zero=3", "FSDP2"),
         ("meshtron zero=3", "DeepSpeed ZeRO-3")]
MIB = 2**20


# ----------------------------------------------------------------------- the configurations


def build(setup: Setup, rank: int, bucket_mb: float, lr: float
          ) -> tuple[Callable[[Any], float], dict[str, Any]]:
    """The model of ``setup`` on this rank and a function running one training step on this
    rank's rows of a global batch (returns the rank's loss sum / global tokens). Every call into
    meshtron is here (and its imports in :func:`run_setup`)."""
    import torch
    import torch.distributed as dist

    from meshtron.config import load_config
    from meshtron.models.init import initialize
    from meshtron.models.transformer import Transformer
    from meshtron.optim.adamw import build_adamw

    cfg = load_config(overrides=OVERRIDES)
    global_tokens = WORLD * MICRO_BATCH * SEQ
    local_tokens = MICRO_BATCH * SEQ
    info: dict[str, Any] = {}

    def rows(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mine = batch[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH]
        return mine[:, :-1], mine[:, 1:]

    if setup.family == "meshtron":
        from dataclasses import replace

        from meshtron.parallel.mesh import ParallelMesh
        from meshtron.plan import plan_run
        from meshtron.rank import build_rank
        from meshtron.training.step import train_step

        cfg = replace(cfg, parallel=replace(cfg.parallel, zero=setup.zero, bucket_mb=bucket_mb))
        plan = plan_run(cfg, WORLD)
        parts = build_rank(plan, ParallelMesh(plan.layout, rank))
        optimizer = parts.optimizer
        info["numel"] = parts.local_params
        info["padded"] = sum(b.padded for b in optimizer.reducer.buckets)
        info["buckets"] = len(optimizer.reducer.buckets)

        def step(batch: torch.Tensor) -> float:
            out = train_step(parts, batch[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH], lr)
            return out.loss / WORLD  # train_step returns the global mean; keep rank shares

        info["memory_bytes"] = lambda: optimizer.memory_bytes()
        return step, info

    model = Transformer(cfg.model)  # the peers: torch DDP, FSDP2, DeepSpeed own the rest
    initialize(model, seed=cfg.train.seed, std=cfg.model.init_std,
               num_layers=cfg.model.num_layers)
    model.train()
    info["numel"] = sum(p.numel() for p in model.parameters())
    clip = cfg.train.grad_clip

    if setup.family in ("ddp", "fsdp2"):
        if setup.family == "ddp":
            net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=bucket_mb)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            device_mesh = init_device_mesh("cpu", (WORLD,))
            for block in model.layers.values():
                fully_shard(block, mesh=device_mesh)
            fully_shard(model, mesh=device_mesh)
            net = model
        optimizer = build_adamw(model, cfg.train)
        for group in optimizer.param_groups:
            group["lr"] = lr

        def step(batch: torch.Tensor) -> float:
            inputs, targets = rows(batch)
            optimizer.zero_grad(set_to_none=True)
            loss = model.loss_sum(net(inputs), targets)
            (loss / local_tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
            optimizer.step()
            return loss.item() / global_tokens

        return step, info

    import deepspeed

    optimizer = build_adamw(model, cfg.train)
    for group in optimizer.param_groups:
        group["lr"] = lr
    ds_config = {
        "train_batch_size": WORLD * MICRO_BATCH,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": setup.zero},
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                      dist_init_required=False)
    assert dist.get_world_size() == WORLD
    info["deepspeed_optimizer"] = type(engine.optimizer).__name__

    def step(batch: torch.Tensor) -> float:
        inputs, targets = rows(batch)
        loss = engine.module.loss_sum(engine(inputs), targets)
        engine.backward(loss / local_tokens)
        engine.step()
        return loss.item() / global_tokens

    return step, info


# ---------------------------------------------------------------------------------- workers


def run_setup(rank: int, setup: Setup, warmup: int, steps: int, bucket_mb: float,
              lr: float) -> dict[str, Any]:
    """One configuration in this process: build, warm up, time ``steps`` steps."""
    import torch
    import torch._dynamo  # noqa: F401 - torch.optim and deepspeed import it: in the baseline
    import torch.distributed as dist
    import torch.distributed.fsdp  # noqa: F401 - imported before the baseline, as torch is

    import meshtron.optim.data_parallel  # noqa: F401
    import meshtron.training.step  # noqa: F401

    if setup.family == "deepspeed":
        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
    base = harness.vm_status()["VmRSS"]
    started = time.perf_counter()
    step, info = build(setup, rank, bucket_mb, lr)
    setup_s = time.perf_counter() - started
    after_build = harness.vm_status()["VmRSS"]
    vocab = 4096
    times, cpu_times, losses = [], [], []
    peak_reset = False
    for i in range(warmup + steps):
        batch = torch.randint(0, vocab, (WORLD * MICRO_BATCH, SEQ + 1),
                              generator=torch.Generator().manual_seed(1000 + i))
        if i == warmup:
            peak_reset = harness.reset_peak_rss()
        run = harness.timed(functools.partial(step, batch), barrier=dist.barrier,
                            cpu=time.process_time)
        total = torch.tensor([run.value], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(float(total))
        if i >= warmup:
            times.append(run.wall)
            cpu_times.append(run.cpu)
    status = harness.vm_status()
    memory = info.pop("memory_bytes", None)
    return {
        "times": times, "cpu_times": cpu_times, "losses": losses, "setup_s": setup_s,
        "base_rss": base, "after_build_rss": after_build, "peak_rss": status["VmHWM"],
        "peak_rss_is_steps_only": peak_reset,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "memory_bytes": memory() if memory else None, **info,
    }


def setup_task(rank: int, world: int, *args: Any) -> dict[str, Any]:
    """Worker body: :func:`run_setup` with torchrun's rank variables set (DeepSpeed asserts
    LOCAL_RANK)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    return run_setup(rank, *args)


# ---------------------------------------------------------------------------------- report


def formula_bytes(zero: int, numel: int, padded: int) -> dict[str, int]:
    """docs/parallelism.md: bytes kept per rank for N parameters (fp32, Adam), dp ranks (fp32
    parameters are their own master weights)."""
    if zero == 0:
        return {"params": 4 * numel, "grads": 4 * padded, "master": 0, "optimizer": 8 * numel}
    return {"params": 4 * padded // (WORLD if zero == 3 else 1),
            "grads": 4 * padded // (1 if zero == 1 else WORLD),
            "master": 0, "optimizer": 8 * padded // WORLD}


def step_times(run: list[dict[str, Any]], key: str = "times") -> list[float]:
    """Per timed step: the slower rank's wall time (``times``) or the ranks' mean CPU time."""
    per_rank = (rank[key] for rank in run)
    return harness.across_ranks(per_rank, max if key == "times" else statistics.mean)


def peak_over_base(run: list[dict[str, Any]]) -> float:
    """MiB: the largest rank's peak RSS (timed steps) minus its RSS before the model."""
    return max(rank["peak_rss"] - rank["base_rss"] for rank in run) / MIB


def summarize(name: str, runs: list[list[dict[str, Any]]],
              memory_runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One configuration over all rounds."""
    per_round = [step_times(run) for run in runs]
    cpu_round = [step_times(run, "cpu_times") for run in runs]
    first = runs[0]
    row = {
        "name": name, "s_per_step": statistics.median(itertools.chain(*per_round)),
        "round_medians": [statistics.median(r) for r in per_round],
        "cpu_s_per_step": statistics.median(itertools.chain(*cpu_round)),
        "cpu_round_medians": [statistics.median(r) for r in cpu_round],
        "steps": per_round, "cpu_steps": cpu_round,
        "peak_over_base_mib": statistics.median(peak_over_base(run) for run in runs),
        "peak_over_base_rounds_mib": [peak_over_base(run) for run in runs],
        "base_mib": statistics.median(max(r["base_rss"] for r in run) for run in runs) / MIB,
        "ru_maxrss_mib": statistics.median(max(r["ru_maxrss"] for r in run)
                                           for run in runs) / MIB,
        "setup_s": statistics.median(max(r["setup_s"] for r in run) for run in runs),
        "losses": first[0]["losses"], "memory_bytes": [r["memory_bytes"] for r in first],
        "numel": first[0].get("numel"), "padded": first[0].get("padded"),
        "buckets": first[0].get("buckets"),
        "deepspeed_optimizer": first[0].get("deepspeed_optimizer"),
        "peak_rss_is_steps_only": all(r["peak_rss_is_steps_only"] for run in runs for r in run),
    }
    if memory_runs:
        row["mmap_peak_over_base_mib"] = statistics.median(peak_over_base(run)
                                                           for run in memory_runs)
        row["mmap_peak_over_base_rounds_mib"] = [peak_over_base(run) for run in memory_runs]
    return row


def run_rounds(args: Any) -> dict[str, dict[str, Any]]:
    """Every configuration in fresh processes, ``--rounds`` rounds then ``--memory-rounds``
    with the exact allocator, the order rotating every round; a summary per configuration."""
    names = list(args.configs)
    runs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    memory_runs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    plan = [(r, False) for r in range(args.rounds)]
    plan += [(r, True) for r in range(args.memory_rounds)]
    for r, mmap in plan:
        for name in harness.rotated(names, r):
            setup = (SETUPS[name], args.warmup, 3 if mmap else args.steps, args.bucket_mb,
                     args.lr)
            result = harness.spawn(setup_task, WORLD, *setup, timeout=args.timeout,
                                   env=harness.EXACT_ALLOCATOR if mmap else None)
            (memory_runs if mmap else runs)[name].append(result)
            print(f"  {'memory' if mmap else 'round'} {r + 1}: {name:<17} "
                  f"{statistics.median(step_times(result)):.3f} s/step "
                  f"(CPU {statistics.median(step_times(result, 'cpu_times')):.3f}), "
                  f"peak - base {peak_over_base(result):6.1f} MiB", flush=True)
    return {n: summarize(n, runs[n], memory_runs[n]) for n in names}


def pair_figures(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """meshtron / peer for every pair that ran: time, round, CPU and memory ratios."""
    nan = float("nan")
    return [{
        "meshtron": ours, "peer": theirs,
        "time_ratio": rows[ours]["s_per_step"] / rows[theirs]["s_per_step"],
        "round_time_ratio": harness.pair_ratio(rows[ours]["round_medians"],
                                               rows[theirs]["round_medians"]),
        "cpu_ratio": rows[ours]["cpu_s_per_step"] / rows[theirs]["cpu_s_per_step"],
        "memory_ratio": rows[ours]["peak_over_base_mib"] / rows[theirs]["peak_over_base_mib"],
        "mmap_memory_ratio": (rows[ours].get("mmap_peak_over_base_mib", nan)
                              / rows[theirs].get("mmap_peak_over_base_mib", nan)),
    } for ours, theirs in PAIRS if ours in rows and theirs in rows]


def print_tables(rows: dict[str, dict[str, Any]], pairs: list[dict[str, Any]]) -> None:
    nan = float("nan")
    exact = " ".join(f"{k}={v}" for k, v in harness.EXACT_ALLOCATOR.items())
    print("\ns/step: median over all timed steps of all rounds (slower rank); CPU s/step: "
          "process CPU time (all threads), mean of the ranks; peak - base: peak RSS in the timed "
          "steps minus RSS before the model (largest rank; median of rounds), with default "
          f"malloc and with {exact}\n")
    print(harness.markdown_table(
        ("configuration", "s/step", "CPU s/step", "base MiB", "peak-base", "(mmap)",
         "ru_maxrss", "round medians s/step"),
        ((r["name"], f"{r['s_per_step']:.3f}", f"{r['cpu_s_per_step']:.3f}",
          f"{r['base_mib']:.0f}", f"{r['peak_over_base_mib']:.1f}",
          f"{r.get('mmap_peak_over_base_mib', nan):.1f}", f"{r['ru_maxrss_mib']:.0f}",
          " ".join(f"{m:.3f}" for m in r["round_medians"])) for r in rows.values())))
    print("\nratio = meshtron / peer (below 1: meshtron faster or smaller); round = median over "
          "rounds of the ratio of the two per-round medians\n")

    def pair_row(p: dict[str, Any]) -> tuple[str, ...]:
        a, b = rows[p["meshtron"]], rows[p["peer"]]
        mmap = "mmap_peak_over_base_mib"
        return (p["meshtron"], p["peer"], f"{a['s_per_step']:.3f} / {b['s_per_step']:.3f}",
                f"{p['time_ratio']:.2f}", f"{p['round_time_ratio']:.2f}",
                f"{p['cpu_ratio']:.2f}",
                f"{a['peak_over_base_mib']:.1f} / {b['peak_over_base_mib']:.1f}",
                f"{p['memory_ratio']:.2f}",
                f"{a.get(mmap, nan):.1f} / {b.get(mmap, nan):.1f}", f"{p['mmap_memory_ratio']:.2f}")

    print(harness.markdown_table(
        ("meshtron", "peer", "s/step", "ratio", "round", "CPU ratio", "peak-base MiB", "ratio",
         "(mmap) MiB", "ratio"), (pair_row(p) for p in pairs)))
    print("\nmeshtron optimizer.memory_bytes() per rank vs docs/parallelism.md "
          "(MiB: params / grads / fp32 master / moments)")
    for row in rows.values():
        if row["memory_bytes"][0] is None:
            continue
        expected = formula_bytes(SETUPS[row["name"]].zero, row["numel"], row["padded"])
        got = row["memory_bytes"]
        same = all(g == expected for g in got)
        print(f"{row['name']:<16} measured "
              f"{' / '.join(f'{got[0][k] / MIB:.2f}' for k in expected)} = "
              f"{sum(got[0].values()) / MIB:.2f}; formula "
              f"{' / '.join(f'{expected[k] / MIB:.2f}' for k in expected)} = "
              f"{sum(expected.values()) / MIB:.2f}  ({'equal' if same else 'DIFFERENT'} on "
              f"every rank; N = {row['numel']}, padded {row['padded']} in {row['buckets']} "
              "buckets)")


def main() -> None:
    cli = harness.cli
    parser = cli.parser(__doc__, cli.steps(12, "timed steps per run (>= 10)"), cli.warmup(3),
                        cli.rounds(5, "timed runs of every configuration, interleaved"),
                        cli.configs(list(SETUPS)), cli.timeout(600, "seconds per run"))
    parser.add_argument("--memory-rounds", type=int, default=1,
                        help=f"extra runs per configuration with {dict(harness.EXACT_ALLOCATOR)} "
                             "(0: none)")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="meshtron parallel.bucket_mb and DDP bucket_cap_mb")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    info = harness.host_info(deepspeed=harness.package_version("deepspeed"))
    print(harness.host_line(info, f"deepspeed {info['deepspeed']}"), flush=True)
    print(f"dp={WORLD} gloo, 1 thread per process; tiny llama (4 x 256, vocab 4096), seq {SEQ}, "
          f"micro-batch {MICRO_BATCH} per rank, fp32 AdamW; {args.rounds} rounds x "
          f"({args.warmup} warm-up + {args.steps} timed steps); bucket {args.bucket_mb} MB",
          flush=True)
    rows = run_rounds(args)
    first = [row["losses"][0] for row in rows.values()]
    if max(first) - min(first) > 1e-5 * abs(first[0]):
        raise AssertionError(f"first-step losses differ: "
                             f"{ {n: r['losses'][0] for n, r in rows.items()} }")
    print(f"\nfirst-step loss {first[0]:.6f} in every configuration; loss after "
          f"{args.warmup + args.steps} steps: "
          + ", ".join(f"{n} {r['losses'][-1]:.4f}" for n, r in rows.items()))
    pairs = pair_figures(rows)
    print_tables(rows, pairs)
    harness.write_json(args.json, harness.record(info, args=harness.plain_args(args),
                                                 configurations=rows, pairs=pairs))


if __name__ == "__main__":
    main()
