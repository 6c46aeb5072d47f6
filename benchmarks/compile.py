"""``train.compile=true`` against eager: one process and tp=2 (gloo, CPU).

Run from the repository root::

    .venv/bin/python benchmarks/compile.py [--steps N] [--json OUT]

The model and step are ``benchmarks/tensor_parallel.py``'s (a small llama: 4 layers, hidden
256, seq 128, micro-batch 4, fp32, AdamW, grad clip) built through meshtron's run plan, with
and without ``--train.compile=true`` (each decoder block compiled, the collectives between the
graphs eager). Per layout one process group (1 or 2 spawned processes, one thread each) builds
both variants. The first step of each is timed on its own (for the compiled one it includes
the compile: Inductor's cache is pointed at a fresh directory, so the compile is cold); the
losses of the first three steps must agree (1e-4 relative); then ``--steps`` rounds alternate
the two, the order rotating. Figures are rank 0's medians and the pair ratio (compiled /
eager in the same round).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import asdict
from typing import Any

import harness
import torch.distributed as dist
from tensor_parallel import Shape, build_meshtron

TIMEOUT = 900
VARIANTS = ("eager", "compiled")


def task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    s = Shape(**args["shape"])
    barrier = dist.barrier if world > 1 else None
    sp = args["sp"]
    steps = {"eager": build_meshtron(rank, s, sp, world)[1],
             "compiled": build_meshtron(rank, s, sp, world, "--train.compile=true")[1]}
    first = {v: harness.timed(step, barrier=barrier) for v, step in steps.items()}
    losses = {v: [first[v].value] + [step() for _ in range(2)] for v, step in steps.items()}
    run = harness.interleave(steps, args["steps"], warmup=1, barrier=barrier)
    return {"first_step_s": {v: t.wall for v, t in first.items()}, "losses": losses,
            "times": run.wall}


def bench(tp: int, sp: bool, args: Any, shape: Shape) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache:
        ranks = harness.spawn(task, tp, {"shape": asdict(shape), "steps": args.steps, "sp": sp},
                              timeout=TIMEOUT, env={"TORCHINDUCTOR_CACHE_DIR": cache})
    r = ranks[0]
    for i in range(3):
        harness.check_close({v: r["losses"][v][i] for v in VARIANTS}, f"tp={tp} step {i + 1}")
    median = {v: statistics.median(t) for v, t in r["times"].items()}
    return {"tp": tp, "sp": sp, "first_step_s": r["first_step_s"], "median_s": median,
            "ratio": median["compiled"] / median["eager"],
            "pair_ratio": harness.pair_ratio(r["times"]["compiled"], r["times"]["eager"]),
            "losses": r["losses"], "times": r["times"]}


def main() -> None:
    cli = harness.cli
    parser = cli.parser(__doc__, cli.steps(20, "timed rounds per layout"))
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers
    info = harness.host_info()
    print(harness.host_line(info, "gloo, 1 thread per process"))
    shape = Shape()
    result = harness.record(info, shape=asdict(shape))
    result["layouts"] = [bench(tp, sp, args, shape) for tp, sp in ((1, False), (2, False),
                                                                  (2, True))]
    print(f"\n{shape}: rank 0, first step timed alone (compile included, cold cache), then "
          f"median of {args.steps} alternating rounds\n")
    print(harness.markdown_table(
        ("layout", "first step eager s", "first step compiled s", "eager s/step",
         "compiled s/step", "compiled / eager", "pair ratio"),
        ((f"tp={r['tp']}" + (" sp" if r["sp"] else ""), f"{r['first_step_s']['eager']:.2f}",
          f"{r['first_step_s']['compiled']:.1f}", f"{r['median_s']['eager']:.3f}",
          f"{r['median_s']['compiled']:.3f}", f"{r['ratio']:.3f}", f"{r['pair_ratio']:.3f}")
         for r in result["layouts"])))
    result["load_average_end"] = os.getloadavg()
    print(f"\nload average at the end: {result['load_average_end'][0]:.2f}")
    harness.write_json(args.json, result)


if __name__ == "__main__":
    main()
