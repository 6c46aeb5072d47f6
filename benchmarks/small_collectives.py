"""Small collectives on gloo: meshtron's one-round exchange vs gloo's own algorithms.

Per world size and buffer size, one all-reduce, reduce-scatter and all-gather through
``meshtron.parallel.tensor.collectives`` (which takes one all-to-all round over more than two
gloo ranks for buffers up to ``exchange.MAX_EXCHANGE_BYTES``) and through ``torch.distributed``
directly (gloo's rings), interleaved in rounds on the same ranks; milliseconds per call
(medians over rounds of ``--calls`` calls each) and the pair ratio meshtron / gloo.

    .venv/bin/python benchmarks/small_collectives.py --worlds 2 4 --rounds 5
"""

from __future__ import annotations

import statistics

from harness import (
    cli,
    host_info,
    host_line,
    interleave,
    markdown_table,
    pair_ratio,
    plain_args,
    record,
    spawn,
    write_json,
)

SIZES = (1024, 16384, 262144)
"""Buffer sizes in fp32 elements (4 KB, 64 KB, 1 MB): a loss or norm, a tiny model's
activations, a gradient bucket."""


def _calls(rank: int, world: int, size: int) -> dict:
    """The competitors of one buffer size: name -> one call."""
    import torch
    import torch.distributed as dist

    from meshtron.parallel.mesh import MeshLayout, ParallelMesh
    from meshtron.parallel.tensor import collectives as c

    group = ParallelMesh(MeshLayout(world, tp=world), rank).tp
    size -= size % world  # whole chunks for the reduce-scatter
    x = torch.ones(size)
    out = torch.empty(size // world)
    full = torch.empty(size * world)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return {
        "all_reduce meshtron": lambda: c.all_reduce(x, group),
        "all_reduce gloo": lambda: dist.all_reduce(x, group=group.pg),
        "reduce_scatter meshtron": lambda: c.reduce_scatter(x, group, dim=0),
        "reduce_scatter gloo": lambda: scatter(out, x, group=group.pg),
        "all_gather meshtron": lambda: c.all_gather(x, group, dim=0),
        "all_gather gloo": lambda: gather(full, x, group=group.pg),
    }


def task(rank: int, world: int, rounds: int, calls: int) -> dict:
    import torch.distributed as dist

    figures = {}
    for size in SIZES:
        competitors = {name: (lambda f=f: [f() for _ in range(calls)])
                       for name, f in _calls(rank, world, size).items()}
        timed = interleave(competitors, rounds, warmup=1, barrier=dist.barrier)
        figures[size] = {name: [w / calls * 1e3 for w in walls]
                         for name, walls in timed.wall.items()}
    return figures


def main() -> None:
    parser = cli.parser(__doc__, cli.rounds(5, "timed rounds per competitor"))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--calls", type=int, default=20, help="calls per timed round")
    args = parser.parse_args()
    info = host_info()
    print(host_line(info))
    rows, report = [], {}
    for world in args.worlds:
        figures = spawn(task, world, args.rounds, args.calls, timeout=600)[0]
        for size, per in figures.items():
            for kind in ("all_reduce", "reduce_scatter", "all_gather"):
                ours, theirs = per[f"{kind} meshtron"], per[f"{kind} gloo"]
                rows.append([world, f"{size * 4 // 1024} KB", kind,
                             f"{statistics.median(ours):.2f}", f"{statistics.median(theirs):.2f}",
                             f"{pair_ratio(ours, theirs):.2f}"])
        report[world] = figures
    print(markdown_table(["ranks", "buffer", "collective", "meshtron ms", "gloo ms",
                          "pair ratio"], rows))
    if args.json:
        write_json(args.json, record(info, args=plain_args(args), figures=report))


if __name__ == "__main__":
    main()
