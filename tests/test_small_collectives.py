"""Small collectives over gloo go as one all-to-all round, with the ring's results.

:mod:`meshtron.parallel.tensor.exchange`: over more than two gloo ranks, small all-reduces,
reduce-scatters and all-gathers (and their asynchronous starts) exchange every rank's rows at
once and reduce them in rank order. Checked against each rank's inputs gathered and reduced
here in float64 (exact for these values), and the all-to-all actually taken (or not:
two ranks, a large buffer).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.parallel.tensor import collectives as c
from tests.distributed import run_distributed


def _inputs(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    if dtype.is_floating_point:  # multiples of 1/8: every sum is exact, in any order
        return (torch.randint(-64, 64, shape, generator=g) / 8).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _everyones(shape: tuple[int, ...], dtype: torch.dtype, world: int) -> torch.Tensor:
    return torch.stack([_inputs(r, shape, dtype) for r in range(world)])


def small_collectives(rank: int, world: int) -> dict:
    """Each collective's result on this rank, and how many all-to-alls each one took."""
    mesh = ParallelMesh(MeshLayout(world, tp=world), rank)
    group, calls, out = mesh.tp, [0], {}
    real = dist.all_to_all_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_to_all_single = counted

    def run(name, fn):
        calls[0] = 0
        out[name] = (fn(), calls[0])

    x = _inputs(rank, (2, 4 * world, 3), torch.float32)
    run("sum", lambda: c.all_reduce(x.clone(), group))
    run("max", lambda: c.all_reduce(x.clone(), group, dist.ReduceOp.MAX))
    run("fp64", lambda: c.all_reduce(_inputs(rank, (5,), torch.float64), group))
    run("int", lambda: c.all_reduce(_inputs(rank, (7,), torch.int64), group))
    run("large", lambda: c.all_reduce(_inputs(rank, (1 << 18,), torch.float32), group))
    run("gather", lambda: c.all_gather(x, group, dim=1))
    run("scatter", lambda: c.reduce_scatter(x, group, dim=1))

    def started(start, flat):
        work = start(flat, group)
        work.wait()
        return flat

    flat = _inputs(rank, (4 * world,), torch.float32)
    run("start_sum", lambda: started(c.start_all_reduce, flat.clone()))
    run("start_scatter", lambda: started(c.start_reduce_scatter, flat.clone()))
    run("start_gather", lambda: started(c.start_all_gather, flat.clone()))
    scratch = torch.empty(4)
    run("start_scatter_out", lambda: (c.start_reduce_scatter(flat.clone(), group,
                                                             out=scratch).wait(), scratch)[1])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_small_collectives_take_one_round_and_give_the_rings_results(world):
    """Over 4 ranks each small collective is one all-to-all; over 2 (a ring of two is one
    exchange already) and for a large buffer, none: gloo's own algorithms."""
    results = run_distributed(small_collectives, world)
    x = _everyones((2, 4 * world, 3), torch.float32, world)
    flat = _everyones((4 * world,), torch.float32, world)
    chunk = 4
    expected = {
        "sum": x.double().sum(0), "max": x.max(0).values,
        "fp64": _everyones((5,), torch.float64, world).sum(0),
        "int": _everyones((7,), torch.int64, world).sum(0),
        "large": _everyones((1 << 18,), torch.float32, world).double().sum(0),
        "gather": torch.cat(list(x), dim=1),
        "start_sum": flat.double().sum(0),
        "start_gather": None, "start_scatter": None, "scatter": None, "start_scatter_out": None,
    }
    for rank, out in enumerate(results):
        for name, (got, alltoalls) in out.items():
            assert alltoalls == (0 if name == "large" or world == 2 else 1), (name, alltoalls)
            want = expected[name]
            if name == "scatter":
                want = x.double().sum(0)[:, rank * chunk:(rank + 1) * chunk]
            elif name == "start_scatter_out":
                want = flat.double().sum(0)[rank * chunk:(rank + 1) * chunk]
            elif name == "start_scatter":  # in place: this rank's chunk summed, the rest its own
                want = flat[rank].clone()
                want[rank * chunk:(rank + 1) * chunk] = flat.sum(0)[rank * chunk:(rank + 1) * chunk]
            elif name == "start_gather":  # every rank's own chunk of its own flat
                want = torch.cat([flat[r, r * chunk:(r + 1) * chunk] for r in range(world)])
            assert torch.equal(got, want.to(got.dtype)), (rank, name)

