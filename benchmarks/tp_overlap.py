"""Overlapped tensor-parallel communication (``parallel.tp_comm_overlap``) against the
whole-collective path and DTensor, at tp=2 and tp=4 on gloo (CPU).

Run from the repository root::

    .venv/bin/python benchmarks/tp_overlap.py [--tp 2 4] [--chunks 1 2 4] [--steps N] [--json OUT]

Every measurement runs in ``tp`` spawned gloo processes (``benchmarks/harness``; one torch
thread and ``OMP_NUM_THREADS=1`` each); figures are rank 0's medians.

1. **Training step** of ``benchmarks/tensor_parallel.py``'s small llama (4 layers, hidden 256,
   seq 128, micro-batch 4, fp32, AdamW, grad clip), all three variants sequence-parallel:
   ``meshtron+sp`` (whole all-gathers and reduce-scatters), ``overlap/C`` for each C of
   ``--chunks`` (``parallel.tp_comm_overlap=true``, C pieces per rank) and ``dtensor+sp``
   (DTensor's plan with ``SequenceParallel``). Same initial weights; the losses are checked to
   agree (1e-4 relative) at the first and last warm-up steps. One process group per tp runs
   the variants in rounds, the order rotating; pair ratio = median over rounds of the two
   variants' steps in the same round.

2. **The MLP pattern** alone, larger (x [4, 128, ``--hidden`` 1024] split by sequence,
   column ``hidden -> ffn`` 4096, GELU, row ``ffn -> hidden``; forward and backward, fp32):
   ``whole`` (gather, products, reduce-scatter), ``overlap/C`` (the chunked path), and
   ``compute only`` (the same products on this rank's shapes with no collective at all). The
   two paths' outputs and gradients are compared; ``exposed communication`` = a path's time
   minus ``compute only``; a negative share "hidden" means overlapping exposed more than it
   hid.

On this 2-core machine the gloo threads that move the pieces share the cores with the GEMMs
(and at tp=4 four processes share two cores), so the figures measure what overlap saves when
communication competes for the same CPU, not what it saves beside a GPU's copy engines.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import asdict
from typing import Any

import harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensor_parallel import Shape, build_dtensor, build_meshtron

from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPRegion,
    column_products,
)

TIMEOUT = 900


def overlapped(chunks: int) -> str:
    return f"overlap/{chunks}"


def steps_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """The three training-step variants in one process group, in rotating rounds."""
    s = Shape(**args["shape"])
    steps = {"meshtron+sp": build_meshtron(rank, s, True, world)[1]}
    for c in args["chunks"]:
        steps[overlapped(c)] = build_meshtron(rank, s, True, world, "--parallel.tp_comm_overlap"
                                              "=true", f"--parallel.tp_comm_chunks={c}")[1]
    steps["dtensor+sp"] = build_dtensor(rank, s, True, tp=world)[1]
    losses = {v: [harness.timed(step, barrier=dist.barrier).value
                  for _ in range(args["warmup"])] for v, step in steps.items()}
    run = harness.interleave(steps, args["steps"], barrier=dist.barrier)
    return {"times": run.wall, "first_loss": {v: x[0] for v, x in losses.items()},
            "last_warmup_loss": {v: x[-1] for v, x in losses.items()}}


def layers_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """The MLP pattern whole, overlapped and without communication, same weights and inputs."""
    b, s, h, ffn = args["batch"], args["seq"], args["hidden"], args["ffn"]
    gen = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(ffn, h, generator=gen) * 0.02, torch.randn(h, ffn, generator=gen) * 0.02
    x = torch.randn(b, s, h, generator=gen).chunk(world, dim=1)[rank].contiguous()
    grad_out = torch.randn(b, s, h, generator=gen).chunk(world, dim=1)[rank].contiguous()
    mesh = ParallelMesh(MeshLayout(world, tp=world, sp=True), rank)
    regions = {"whole": TPRegion(mesh.tp, True),
               **{overlapped(c): TPRegion(mesh.tp, True, c) for c in args["chunks"]}}
    pairs = {}
    for name, region in regions.items():
        col = ColumnParallelLinear(h, ffn, False, region)
        row = RowParallelLinear(ffn, h, False, region)
        with torch.no_grad():
            col.weight.copy_(w1.chunk(world, dim=0)[rank])
            row.weight.copy_(w2.chunk(world, dim=1)[rank])
        pairs[name] = (region, col, row)

    def path(name: str):
        region, col, row = pairs[name]

        def call() -> tuple[torch.Tensor, ...]:
            inp = x.clone().requires_grad_()
            col.weight.grad = row.weight.grad = None
            (hidden,) = column_products(region, inp, [col])
            y = row(F.gelu(hidden, approximate="tanh"))
            y.backward(grad_out)
            return y.detach(), inp.grad, col.weight.grad, row.weight.grad
        return call

    local_w1 = w1.chunk(world, dim=0)[rank].clone().requires_grad_()
    local_w2 = w2.chunk(world, dim=1)[rank].clone().requires_grad_()
    full_x, full_grad = x.repeat(1, world, 1), grad_out.repeat(1, world, 1)

    def compute_only() -> None:
        """The same products on this rank's shapes (whole sequence in, whole sequence out)."""
        inp = full_x.clone().requires_grad_()
        local_w1.grad = local_w2.grad = None
        F.linear(F.gelu(F.linear(inp, local_w1), approximate="tanh"), local_w2).backward(full_grad)

    calls = {name: path(name) for name in regions} | {"compute only": compute_only}
    whole = calls["whole"]()
    diffs = {name: max(float((a - c).abs().max()) for a, c in zip(calls[name](), whole))
             for name in regions if name != "whole"}
    run = harness.interleave(calls, args["steps"], warmup=args["warmup"], barrier=dist.barrier)
    return {"max_abs_diff": diffs, "times": run.wall}


def bench_steps(tp: int, args: Any, shape: Shape) -> dict[str, Any]:
    ranks = harness.spawn(steps_task, tp, {"shape": asdict(shape), "warmup": args.warmup,
                                           "steps": args.steps, "chunks": args.chunks},
                          timeout=TIMEOUT)
    for key in ("first_loss", "last_warmup_loss"):
        harness.check_close(ranks[0][key], f"tp={tp} {key}", reference="meshtron+sp")
    times = ranks[0]["times"]
    median = {v: statistics.median(t) for v, t in times.items()}
    ratios = {peer: {v: {"ratio": median[v] / median[peer],
                         "pair": harness.pair_ratio(times[v], times[peer])}
                     for v in times if v.startswith("overlap")}
              for peer in ("meshtron+sp", "dtensor+sp")}
    return {"tp": tp, "median_s": median, "times": times, "ratios": ratios,
            "first_loss": ranks[0]["first_loss"]}


def bench_layers(tp: int, args: Any) -> dict[str, Any]:
    dims = {"batch": 4, "seq": 128, "hidden": args.hidden, "ffn": args.ffn}
    ranks = harness.spawn(layers_task, tp, {**dims, "warmup": 3, "steps": args.layer_steps,
                                            "chunks": args.chunks}, timeout=TIMEOUT)
    worst = {k: max(r["max_abs_diff"][k] for r in ranks) for k in ranks[0]["max_abs_diff"]}
    if max(worst.values()) > 1e-4:
        raise AssertionError(f"tp={tp}: overlapped and whole paths differ: {worst}")
    times = ranks[0]["times"]
    median = {v: statistics.median(t) for v, t in times.items()}
    exposed = {v: median[v] - median["compute only"] for v in times if v != "compute only"}
    return {"tp": tp, **dims, "median_s": median, "times": times, "max_abs_diff": worst,
            "exposed_s": exposed,
            "pair_vs_whole": {v: harness.pair_ratio(times[v], times["whole"])
                              for v in exposed if v != "whole"}}


def print_results(result: dict[str, Any], args: Any) -> None:
    print(f"\ntraining step, sequence-parallel: median s/step of {args.steps} rotating rounds "
          f"(rank 0) after {args.warmup} warm-up; ratio and pair ratio against each peer\n")
    rows = []
    for r in result["steps"]:
        for v, t in r["median_s"].items():
            cells = [f"{r['ratios'][peer][v]['ratio']:.3f} / {r['ratios'][peer][v]['pair']:.3f}"
                     if v in r["ratios"][peer] else "" for peer in ("meshtron+sp", "dtensor+sp")]
            rows.append((r["tp"], v, f"{t:.3f}", *cells))
    print(harness.markdown_table(("tp", "variant", "s/step", "vs meshtron+sp", "vs dtensor+sp"),
                                 rows))
    print(f"\nMLP pattern, x [4, 128, {args.hidden}] -> {args.ffn} -> {args.hidden}, forward and "
          f"backward: median s/iteration of {args.layer_steps} rounds (rank 0); exposed = the "
          "time beyond compute only\n")
    rows = []
    for r in result["layers"]:
        for v, t in r["median_s"].items():
            exposed = r["exposed_s"].get(v)
            rows.append((r["tp"], v, f"{t:.4f}", "" if exposed is None else f"{exposed:.4f}",
                         f"{r['pair_vs_whole'][v]:.3f}" if v in r["pair_vs_whole"] else "",
                         f"{r['max_abs_diff'][v]:.1e}" if v in r["max_abs_diff"] else ""))
    print(harness.markdown_table(("tp", "variant", "s/iter", "exposed comm s",
                                  "pair ratio vs whole", "max abs diff vs whole"), rows))


def main() -> None:
    cli = harness.cli
    parser = cli.parser(__doc__, cli.steps(20, "timed rounds of training steps"), cli.warmup(3))
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4],
                        help="parallel.tp_comm_chunks values to measure")
    parser.add_argument("--layer-steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers
    info = harness.host_info()
    print(harness.host_line(info, "gloo, 1 thread per process"))
    shape = Shape()
    result = harness.record(info, shape=asdict(shape), chunks=args.chunks)
    result["steps"] = [bench_steps(tp, args, shape) for tp in args.tp]
    result["layers"] = [bench_layers(tp, args) for tp in args.tp]
    print_results(result, args)
    result["load_average_end"] = os.getloadavg()
    print(f"\nload average at the end: {result['load_average_end'][0]:.2f}")
    harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
