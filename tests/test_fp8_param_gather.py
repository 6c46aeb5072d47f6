"""precision.fp8_param_gather: ZeRO-3 gathers the low-precision layers' weights as E4M3.

The gathered weights are bit for bit the FP8 round trip of the whole weights (what one process
computes with); the bytes gathered are the closed form (one byte per FP8 weight element, the
other parameters in their own dtype); the round trip is idempotent, so a layer applying it to a
gathered weight changes nothing; and training matches one process (tests/
test_low_precision_training.py runs it beside the other layouts)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshtron.config import load_config
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.plan import plan_run
from meshtron.precision.fp8 import E4M3
from meshtron.precision.mx import MXScaling
from meshtron.precision.param_gather import GatheredWeights, WeightGather
from meshtron.rank import amax_agreement, build_rank
from meshtron.training.step import train_step
from tests.distributed import run_distributed

MODEL = ["--model.num_layers=2", "--model.hidden_size=64", "--model.num_heads=4",
         "--model.num_kv_heads=4", "--model.ffn_hidden_size=128", "--model.max_seq_len=64",
         "--model.vocab_size=512", "--train.seq_len=32", "--train.global_batch=8",
         "--train.micro_batch=2", "--train.peak_flops=1e12", "--precision.dtype=bf16",
         "--parallel.zero=3", "--precision.keep_layers=0"]
"""Block 0 kept in bf16: its bucket's weights travel in bf16, block 1's in FP8."""
STEPS = 2
RECIPES = {"mxfp8": [], "tensorwise": ["--model.moe.num_experts=4", "--model.moe.top_k=2"]}
"""The MoE run's block bucket mixes FP8 attention weights with the router's and the experts'
(kept in bf16), so its packs hold both kinds."""


def full_weights(rank) -> dict[str, torch.Tensor]:
    """Every parameter, whole, from the ranks' high-precision shards (not the FP8 gather)."""
    out = {}
    for flat in rank.optimizer.flats:
        full = torch.empty(flat.bucket.padded, dtype=flat.shard.dtype)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(full, flat.shard, group=flat.group.pg)
        for i, param in enumerate(flat.bucket.params):
            out[id(param)] = flat.bucket.view(full, i).clone()
    return out


def closed_form_bytes(flat, fp8_ids: set[int]) -> int:
    """Bytes one rank sends per gather of ``flat``: (d - 1) x the longest rank's pack, a pack
    holding each FP8 weight element as 1 byte and any other element in its own dtype."""
    return gathered_bytes(flat, lambda n: n, fp8_ids)


def gathered_bytes(flat, low_precision_bytes, low_ids: set[int]) -> int:
    """(d - 1) x the longest rank's pack: a run of ``n`` elements of a weight in ``low_ids``
    takes ``low_precision_bytes(n)``, any other element its dtype's size."""
    bucket, d = flat.bucket, flat.group.size
    size, itemsize = bucket.padded // d, flat.shard.element_size()
    packs = []
    for r in range(d):
        total = 0
        for param, offset, shape in zip(bucket.params, bucket.offsets, bucket.shapes):
            n = max(0, min((r + 1) * size, offset + shape.numel()) - max(r * size, offset))
            total += low_precision_bytes(n) if id(param) in low_ids else n * itemsize
        packs.append(total)
    return (d - 1) * max(packs)


def gather_runs(rank: int, world_size: int) -> dict[str, dict]:
    return {fp8: gather_run(rank, world_size, fp8, knobs=knobs) for fp8, knobs in RECIPES.items()}


def gather_run(rank: int, world_size: int, fp8: str, tp: int = 1,
               knobs: list[str] | None = None) -> dict:
    cfg = load_config(overrides=MODEL + (knobs or []) + [
                                         f"--precision.fp8={fp8}", f"--parallel.tp={tp}",
                                         "--precision.fp8_param_gather=true"])
    mesh = ParallelMesh(MeshLayout.of(cfg.parallel, world_size), rank)
    gather = WeightGather(amax_agreement(mesh))  # the whole weight's amax under tp
    r = build_rank(plan_run(cfg, world_size), mesh)
    if mesh.tp.rank == 1:  # tp slices 64x apart: a slice's own scale is not the weight's
        for flat, master in zip(r.optimizer.flats, r.optimizer.adamw.master):
            master.mul_(64.0)
            if master is not flat.shard:
                flat.shard.mul_(64.0)
    layers = {m: name for name, m in r.model.named_modules() if getattr(m, "fp8", None)}
    fp8_ids = {id(m.weight) for m in layers}
    seen: list[tuple[torch.nn.Module, torch.Tensor]] = []
    for module in layers:
        module.register_forward_pre_hook(
            lambda m, args: seen.append((m, m.weight.detach().clone())))
    others: list[tuple[int, torch.Tensor]] = []  # the rest of each block, as gathered
    rest = {id(p) for f in r.optimizer.flats for p in f.bucket.params} - fp8_ids
    for block in r.model.blocks():
        block.register_forward_pre_hook(lambda m, args: others.extend(
            (id(p), p.detach().clone()) for p in m.parameters() if id(p) in rest))
    launched = count_gathers(r.optimizer.flats)
    groups = {f.group.name: f.group for f in r.optimizer.flats}
    mismatched, forwards, measured, expected = [], 0, [], []
    for step in range(STEPS):
        whole = full_weights(r)
        seen.clear()
        others.clear()
        launched.clear()
        sent_bytes(groups)
        batch = torch.randint(0, 512, (8, 33), generator=torch.Generator().manual_seed(step))
        train_step(r, batch[mesh.dp.rank * 4 : (mesh.dp.rank + 1) * 4], 3e-3)
        measured.append(sent_bytes(groups))
        for module, weight in seen:
            want = gather.round_trip(whole[id(module.weight)])
            forwards += 1
            if not torch.equal(weight, want):
                mismatched.append((step, layers[module]))
        mismatched += [(step, tuple(p.shape)) for i, p in others if not torch.equal(p, whole[i])]
        expected.append(sum(closed_form_bytes(f, fp8_ids) * launched[f.bucket.index]
                            for f in r.optimizer.flats))
    fp8_flats = [f for f in r.optimizer.flats if f.fp8 is not None]
    return {"mismatched": mismatched, "forwards": forwards, "measured": measured,
            "expected": expected, "layers": len(layers),
            "mixed": any(seg.weight is None for f in fp8_flats for segs in f.fp8.segments
                         for seg in segs),
            "fp8_buckets": sum(f.fp8 is not None for f in r.optimizer.flats),
            "fp8_vs_dtype": [(closed_form_bytes(f, fp8_ids), closed_form_bytes(f, set()))
                             for f in r.optimizer.flats if f.fp8 is not None]}


def sent_bytes(groups: dict) -> int:
    """All-gather bytes this rank sent over the buckets' groups since the last call (the
    groups may share one stats object, which ``take`` empties)."""
    stats = {id(g.stats): g.stats for g in groups.values()}
    counts = {k: v for s in stats.values() for k, v in s.take().items()}
    return sum(counts.get(f"{name}/all_gather", 0) for name in groups)


def count_gathers(flats) -> dict[int, int]:
    """Counts, per bucket, the all-gathers each flat launches (forward and backward of each
    micro-batch for a block, fewer for the root unit, which stays gathered)."""
    launched: dict[int, int] = {}
    for flat in flats:
        def start(flat=flat, original=flat.start_gather):
            idle = flat.full is None and flat.work is None
            original()
            if idle:
                launched[flat.bucket.index] = launched.get(flat.bucket.index, 0) + 1
        flat.start_gather = start
    return launched


@pytest.mark.slow
def test_zero3_gathers_fp8_weights_bit_for_bit_in_closed_form_bytes():
    """Every forward of every low-precision layer under dp=2 ZeRO-3 (MXFP8, tensor-wise FP8)
    sees exactly round_trip(whole weight); the gathers' bytes are the closed form."""
    results = run_distributed(gather_runs, 2)
    for rank, fp8, got in [(r, f, g) for r, runs in enumerate(results) for f, g in runs.items()]:
        assert got["fp8_buckets"] == 1, got  # block 1's bucket; block 0 is kept in bf16
        assert got["forwards"] == STEPS * 2 * got["layers"] > 0, got  # 2 micro-batches
        assert not got["mismatched"], (rank, fp8, got["mismatched"])
        assert got["measured"] == got["expected"], (rank, fp8, got)
        assert got["mixed"] == bool(RECIPES[fp8]), got  # the MoE block's bucket mixes kinds
        for fp8_bytes, bf16_bytes in got["fp8_vs_dtype"]:  # 1 byte per element vs 2
            low = 0.5 if not got["mixed"] else 0.51
            assert low <= fp8_bytes / bf16_bytes < (0.51 if not got["mixed"] else 1.0), got


@pytest.mark.slow
def test_zero3_fp8_gather_agrees_each_weights_amax_over_tp():
    """tp=2 x dp=2: a weight's scale comes from the amax of the whole weight (its tp slices'
    amaxes agreed), as the layer's own round trip takes it: still bit for bit."""
    for rank, got in enumerate(run_distributed(gather_run, 4, "mxfp8", 2)):
        assert got["forwards"] == STEPS * 2 * got["layers"] > 0, got
        assert not got["mismatched"], (rank, got["mismatched"])
        assert got["measured"] == got["expected"], (rank, got)


def test_round_trip_is_idempotent_and_what_mxfp8_quantises():
    """round_trip(round_trip(w)) == round_trip(w) bit for bit (power-of-two scales), for bf16
    and fp32 weights with subnormal, huge and zero values; the gathered recipe's forward is
    MXFP8 of the round-tripped weight."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 64),
                                                                     generator=g).float())
    w[0, :8] = 0.0
    w[1, :4] = 1e-40
    gather = WeightGather()
    for dtype in (torch.float32, torch.bfloat16):
        once = gather.round_trip(w.to(dtype))
        assert once.dtype == dtype
        assert torch.equal(gather.round_trip(once), once)
        assert not torch.equal(once, w.to(dtype))  # it does quantise
    recipe = GatheredWeights(MXScaling(), gather)
    qw = recipe.quantize(w, "weight", E4M3)
    want = MXScaling().quantize(gather.round_trip(w), "weight", E4M3)
    assert torch.equal(qw.dequantize(), want.dequantize())
