"""Context parallelism on CPU: ring vs all-to-all vs all-gather attention, a cp=2 training
step, and the activation memory per rank against the sequence length.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/context_parallel.py [--json OUT] [--quick]

**Peer.** PyTorch's own ``torch.distributed.tensor.experimental.context_parallel`` is tried
first, on a one-layer model in two gloo processes; on CPU it fails (its exact error is printed
and recorded), so the peer is the all-gather-KV attention of Llama 3 (``parallel.cp_comm=
all_gather``, meshtron's own implementation of it): every rank gathers the whole sequence's
keys and values.

**1. Attention alone** (2 spawned gloo processes, cp=2, one torch thread each): forward +
backward of ``meshtron.parallel.context.attention.attend`` for each ``cp_comm`` on this rank's
queries [1, 8 heads, S/2, 32] with 4 kv heads (GQA), fp32, causal, for each sequence length S;
``--reps`` interleaved rounds after 2 warm-up rounds, the order rotating every round; per
algorithm the median of the slower rank's time per round, and the ratio to all_gather.

**2. Training step** (2 processes, cp=2): meshtron's ``Trainer``-built stack (the run plan,
``Transformer``, ``build_optimizer``, ``train_step``) on the ``tiny`` llama shape at
``--train-seq`` tokens, micro-batch 1, on random tokens; ``--steps`` timed steps per algorithm
after ``--warmup``, interleaved, slowest rank per step; ratio of medians to all_gather. The
three must give the same loss (checked).

**3. Activations per rank** (``tiny-long``, 4 layers, hidden 256): bytes autograd keeps for
backward in one forward + loss of one sequence (``harness.saved_activation_bytes``), at cp = 1, 2
and 4 (ring), for each ``--memory-seqs`` length; per rank at cp = c against (cp = 1) / c. Goal:
at most 1.05 x (cp=1) / c.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import harness
import torch
import torch.distributed as dist

ALGORITHMS = ("ring", "all_to_all", "all_gather")
PEER = "all_gather"


def torch_context_parallel(rank: int, world: int) -> str:
    """PyTorch's experimental context_parallel on a one-layer attention model: 'ok' or the
    first line of its error."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    torch.manual_seed(0)
    embed, proj = torch.nn.Embedding(128, 64), torch.nn.Linear(64, 3 * 64)
    tokens = torch.randint(0, 128, (1, 64))
    try:
        with context_parallel(init_device_mesh("cpu", (world,)), buffers=[tokens],
                              buffer_seq_dims=[1]):
            q, k, v = proj(embed(tokens)).view(1, -1, 3, 4, 16).permute(2, 0, 3, 1, 4)
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        return "ok"
    except Exception as err:  # noqa: BLE001 - the peer's failure is the figure recorded
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"


# meshtron: used in attention_task, build_steps and memory_task only


def attention_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Forward + backward of each algorithm's attention per sequence length."""
    from meshtron.parallel.context.attention import attend
    from meshtron.parallel.context.sequence import SequenceSplit
    from meshtron.parallel.mesh import MeshLayout, ParallelMesh

    mesh = ParallelMesh(MeshLayout(world, cp=world), rank)
    out = {}
    for seq in args["seqs"]:
        gen = torch.Generator().manual_seed(rank)
        length = seq // world
        q = torch.randn(1, 8, length, 32, generator=gen, requires_grad=True)
        k, v = (torch.randn(1, 4, length, 32, generator=gen, requires_grad=True)
                for _ in range(2))
        sequence = SequenceSplit(mesh.cp)(torch.zeros(1, seq + 1, dtype=torch.long)).sequence

        def call(algorithm: str, q=q, k=k, v=v, sequence=sequence) -> float:
            y = attend(q, k, v, mesh.cp, sequence, algorithm)
            y.sum().backward()
            return float(y.detach().sum())

        run = harness.interleave({a: (lambda a=a: call(a)) for a in ALGORITHMS}, args["reps"],
                                 warmup=2, barrier=dist.barrier)
        out[seq] = run.wall
    return out


def build_steps(rank: int, world: int, seq: int) -> dict[str, Any]:
    """One training step per algorithm on this rank, through the run plan."""
    from meshtron.config import load_config
    from meshtron.parallel.mesh import ParallelMesh
    from meshtron.plan import plan_run
    from meshtron.rank import build_rank
    from meshtron.training.step import train_step

    steps = {}
    for algorithm in ALGORITHMS:
        cfg = load_config(overrides=[
            "--model.preset=tiny", "--model.vocab_size=4096", f"--model.max_seq_len={seq}",
            f"--train.seq_len={seq}", "--train.global_batch=1", f"--parallel.cp={world}",
            f"--parallel.cp_comm={algorithm}"])
        plan = plan_run(cfg, world)
        parts = build_rank(plan, ParallelMesh(plan.layout, rank))

        def step(batch: torch.Tensor, parts=parts, lr=cfg.train.lr) -> float:
            return train_step(parts, batch, lr).loss

        steps[algorithm] = step
    return steps


def steps_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    steps = build_steps(rank, world, args["seq"])
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 4096, (1, args["seq"] + 1), generator=gen)
               for _ in range(args["warmup"] + args["steps"])]
    times: dict[str, list[float]] = {a: [] for a in ALGORITHMS}
    losses: dict[str, float] = {}
    for i, batch in enumerate(batches):
        for algorithm in harness.rotated(list(ALGORITHMS), i):
            result = harness.timed(lambda a=algorithm, b=batch: steps[a](b), barrier=dist.barrier)
            losses.setdefault(algorithm, result.value)
            if i >= args["warmup"]:
                times[algorithm].append(result.wall)
    return {"times": times, "first_loss": losses}


def memory_task(rank: int, world: int, args: dict[str, Any]) -> dict[int, int]:
    """Activation bytes on this rank of one forward + loss, per sequence length."""
    from meshtron.config import load_config
    from meshtron.models.init import initialize
    from meshtron.models.transformer import Transformer
    from meshtron.parallel.context.sequence import SequenceSplit
    from meshtron.parallel.mesh import MeshLayout, ParallelMesh

    mesh = ParallelMesh(MeshLayout(world, cp=world), rank)
    out = {}
    for seq in args["seqs"]:
        cfg = load_config(overrides=["--model.preset=tiny-long", "--model.vocab_size=512",
                                     f"--train.seq_len={seq}"]).model
        model = Transformer(cfg, mesh)
        initialize(model, seed=0, std=0.02, num_layers=cfg.num_layers)
        window = torch.randint(0, 512, (1, seq + 1), generator=torch.Generator().manual_seed(0))
        mb = SequenceSplit(mesh.cp)(window)

        def step(model=model, mb=mb) -> None:
            model.loss_sum(model(mb.tokens, sequence=mb.sequence), mb.targets)

        out[seq] = harness.saved_activation_bytes(model, step)
    return out


# ---------------------------------------------------------------------------------- report


def median_slowest(per_rank: list[dict[str, list[float]]], name: str) -> float:
    return statistics.median(harness.across_ranks([r[name] for r in per_rank]))


def print_attention(result: dict[str, Any]) -> None:
    rows = []
    for seq, per_rank in result.items():
        medians = {a: statistics.median(harness.across_ranks([r[a] for r in per_rank]))
                   for a in ALGORITHMS}
        rows.append([seq] + [f"{medians[a] * 1e3:.1f}" for a in ALGORITHMS]
                    + [f"{medians[a] / medians[PEER]:.2f}" for a in ALGORITHMS if a != PEER])
    print("\nattention forward + backward, cp=2, ms (slowest rank, median)")
    print(harness.markdown_table(["S", *ALGORITHMS, "ring / all_gather", "a2a / all_gather"],
                                 rows))


def main() -> None:
    cli = harness.cli
    parser = cli.parser(__doc__, cli.steps(5, "timed training steps per algorithm"),
                        cli.warmup(2), cli.timeout(900.0, "per process group, s"),
                        cli.switch("--quick", "smoke run: short sequences, few repetitions"))
    parser.add_argument("--seqs", nargs="+", type=int, default=[1024, 4096, 8192],
                        help="sequence lengths of the attention part")
    parser.add_argument("--reps", type=int, default=5, help="timed attention rounds")
    parser.add_argument("--train-seq", type=int, default=2048, help="training sequence length")
    parser.add_argument("--memory-seqs", nargs="+", type=int, default=[1024, 2048, 4096],
                        help="sequence lengths of the activation part")
    args = parser.parse_args()
    if args.quick:
        args.seqs, args.reps, args.train_seq, args.memory_seqs = [512], 2, 256, [256, 512]
        args.steps, args.warmup = 2, 1
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    info = harness.host_info()
    print(harness.host_line(info))
    result = harness.record(info, args=harness.plain_args(args))
    started = time.perf_counter()

    result["torch_context_parallel"] = harness.spawn(torch_context_parallel, 2,
                                                     timeout=args.timeout)[0]
    print(f"\ntorch.distributed.tensor.experimental.context_parallel on CPU: "
          f"{result['torch_context_parallel']}")

    per_rank = harness.spawn(attention_task, 2, {"seqs": args.seqs, "reps": args.reps},
                             timeout=args.timeout)
    result["attention"] = {seq: [r[seq] for r in per_rank] for seq in args.seqs}
    print_attention(result["attention"])

    steps = harness.spawn(steps_task, 2, {"seq": args.train_seq, "steps": args.steps,
                                          "warmup": args.warmup}, timeout=args.timeout)
    harness.check_close(steps[0]["first_loss"], "first-step losses")
    times = [s["times"] for s in steps]
    medians = {a: median_slowest(times, a) for a in ALGORITHMS}
    result["step"] = {"medians": medians, "per_rank": times,
                      "ratio_to_all_gather": {a: medians[a] / medians[PEER] for a in ALGORITHMS}}
    print(f"\ntraining step, tiny at S={args.train_seq}, cp=2, s/step (slowest rank, median)")
    print(harness.markdown_table(
        ["algorithm", "s/step", "/ all_gather"],
        [[a, f"{medians[a]:.3f}", f"{medians[a] / medians[PEER]:.2f}"] for a in ALGORITHMS]))

    memory = {1: harness.spawn(memory_task, 1, {"seqs": args.memory_seqs},
                               timeout=args.timeout)}
    for cp in (2, 4):
        memory[cp] = harness.spawn(memory_task, cp, {"seqs": args.memory_seqs},
                                   timeout=args.timeout)
    rows = []
    for seq in args.memory_seqs:
        one = memory[1][0][seq]
        ratios = {cp: max(r[seq] for r in memory[cp]) / (one / cp) for cp in (2, 4)}
        rows.append([seq, f"{one / 2**20:.1f}", f"{max(r[seq] for r in memory[2]) / 2**20:.1f}",
                     f"{max(r[seq] for r in memory[4]) / 2**20:.1f}", f"{ratios[2]:.3f}",
                     f"{ratios[4]:.3f}"])
    result["activations"] = {cp: [{str(s): b for s, b in r.items()} for r in runs]
                             for cp, runs in memory.items()}
    print("\nactivations kept for backward per rank, MiB (tiny-long, one sequence; ring)")
    print(harness.markdown_table(["S", "cp=1", "cp=2", "cp=4", "cp=2 / (cp=1 / 2)",
                                  "cp=4 / (cp=1 / 4)"], rows))
    result["seconds"] = time.perf_counter() - started
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}; {result['seconds']:.0f} s")
    harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
