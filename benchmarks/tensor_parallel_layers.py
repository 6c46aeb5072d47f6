"""The layer-pair part of ``benchmarks/tensor_parallel.py`` (its docstring, part 2, says what
runs): meshtron's column -> row parallel linears against megatron-core's, on two gloo ranks."""

from __future__ import annotations

import importlib.util
import statistics
from typing import Any

import harness
import torch
import torch.distributed as dist
from torch import nn

# meshtron: used in build_layer_pair only
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TPRegion

TP = 2


def build_layer_pair(rank: int, h: int, ffn: int) -> tuple[TPRegion, nn.Module, nn.Module]:
    """meshtron's MLP pattern on this rank: the TP region, column- and row-parallel linears."""
    mesh = ParallelMesh(MeshLayout(TP, tp=TP), rank)
    region = TPRegion(mesh.tp)
    col, row = ColumnParallelLinear(h, ffn, False, region), RowParallelLinear(ffn, h, False, region)
    return region, col, row


def layers_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """meshtron's column -> row pair against megatron-core's, same weights and inputs."""
    from peers import megatron_mlp  # imports megatron-core: only in these workers

    b, s, h, ffn = args["batch"], args["seq"], args["hidden"], args["ffn"]
    gen = torch.Generator().manual_seed(1)
    w1 = torch.randn(ffn, h, generator=gen) * 0.02
    w2 = torch.randn(h, ffn, generator=gen) * 0.02
    x = torch.randn(b, s, h, generator=gen)
    grad_out = torch.randn(b, s, h, generator=gen)
    region, ours_col, ours_row = build_layer_pair(rank, h, ffn)
    theirs_col, theirs_row = megatron_mlp.mlp_pair(h, ffn, TP)
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
    run = harness.interleave({"meshtron": ours, "megatron": theirs}, args["steps"],
                             warmup=args["warmup"], barrier=dist.barrier)
    return {"max_abs_diff": diffs, "max_abs_value": scale, "times": run.wall,
            "sequence_parallel_error": megatron_mlp.sequence_parallel_error(x, rank, TP, ffn)}


def bench_layers(hidden: int, ffn: int, steps: int, timeout: float) -> dict[str, Any]:
    dims = {"batch": 4, "seq": 128, "hidden": hidden, "ffn": ffn}
    ranks = harness.spawn(layers_task, TP, {**dims, "warmup": 3, "steps": steps},
                          timeout=timeout)
    worst = {k: max(r["max_abs_diff"][k] for r in ranks) for k in ranks[0]["max_abs_diff"]}
    times = ranks[0]["times"]
    return {**dims, "max_abs_diff": worst,
            "max_abs_value": ranks[0]["max_abs_value"],
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio": harness.ratio_of_medians(times["meshtron"], times["megatron"]),
            "pair_ratio": harness.pair_ratio(times["meshtron"], times["megatron"]),
            "times": times, "sequence_parallel_error": ranks[0]["sequence_parallel_error"]}


def print_layers(result: dict[str, Any]) -> None:
    print(f"\nlayer pair vs megatron-core, tp=2: x [{result['batch']}, {result['seq']}, "
          f"{result['hidden']}] -> column {result['hidden']}->{result['ffn']} -> row "
          f"{result['ffn']}->{result['hidden']}, forward+backward, fp32\n")
    print(harness.markdown_table(
        ("quantity", "max abs diff (both ranks)", "max abs value"),
        ((key, f"{diff:.2e}", f"{result['max_abs_value'][key]:.3g}")
         for key, diff in result["max_abs_diff"].items())))
    m = result["median_s"]
    print()
    print(harness.markdown_table(
        ("meshtron s/iter", "megatron-core s/iter", "ratio", "pair ratio"),
        [(f"{m['meshtron']:.4f}", f"{m['megatron']:.4f}", f"{result['ratio']:.3f}",
          f"{result['pair_ratio']:.3f}")]))
    if result["sequence_parallel_error"]:
        print(f"\nmegatron-core with sequence_parallel=True on CPU: "
              f"{result['sequence_parallel_error']}")


def run(hidden: int, ffn: int, steps: int, timeout: float) -> dict[str, Any]:
    """The comparison and its tables, or a note (and an ``error`` entry) when megatron-core is
    not installed; raises when the two pairs' results differ by more than 1e-5."""
    if importlib.util.find_spec("megatron") is None:
        print("\nmegatron-core layer comparison skipped: megatron-core is not installed "
              "(pip install -e '.[bench]')")
        return {"error": "megatron-core is not installed"}
    result = bench_layers(hidden, ffn, steps, timeout)
    print_layers(result)
    worst = max(result["max_abs_diff"].values())
    if worst > 1e-5:
        raise AssertionError(f"meshtron and megatron-core layers differ by {worst:.2e}")
    return result
