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
from meshtron.rank import build_rank
from meshtron.training.step import train_step
from tests.distributed import run_distributed

MODEL = ["--model.num_layers=2", "--model.hidden_size=64", "--model.num_heads=4",
         "--model.num_kv_heads=4", "--model.ffn_hidden_size=128", "--model.max_seq_len=64",
         "--model.vocab_size=512", "--train.seq_len=32", "--train.global_batch=8",
         "--train.micro_batch=2", "--train.peak_flops=1e12", "--precision.dtype=bf16",
         "--parallel.zero=3", "--precision.keep_layers=0"]
"""Block 0 kept in bf16: its bucket's weights travel in bf16, block 1's in FP8."""
STEPS = 2
RECIPES = ("mxfp8", "tensorwise")


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
    bucket, d = flat.bucket, flat.group.size
    size, itemsize = bucket.padded // d, flat.shard.element_size()
    packs = []
    for r in range(d):
        total = 0
        for param, offset, shape in zip(bucket.params, bucket.offsets, bucket.shapes):
            n = max(0, min((r + 1) * size, offset + shape.numel()) - max(r * size, offset))
            total += n * (1 if id(param) in fp8_ids else itemsize)
        packs.append(total)
    return (d - 1) * max(packs)


def gather_runs(rank: int, world_size: int) -> dict[str, dict]:
    return {fp8: gather_run(rank, world_size, fp8) for fp8 in RECIPES}


def gather_run(rank: int, world_size: int, fp8: str) -> dict:
    cfg = load_config(overrides=MODEL + [f"--precision.fp8={fp8}",
                                         "--precision.fp8_param_gather=true"])
    mesh = ParallelMesh(MeshLayout.of(cfg.parallel, world_size), rank)
    r = build_rank(plan_run(cfg, world_size), mesh)
    layers = {m: name for name, m in r.model.named_modules() if getattr(m, "fp8", None)}
    fp8_ids = {id(m.weight) for m in layers}
    seen: list[tuple[torch.nn.Module, torch.Tensor]] = []
    for module in layers:
        module.register_forward_pre_hook(
            lambda m, args: seen.append((m, m.weight.detach().clone())))
    mismatched, forwards, measured, expected = [], 0, [], []
    for step in range(STEPS):
        whole = full_weights(r)
        seen.clear()
        group = r.optimizer.flats[0].group
        group.stats.take()
        batch = torch.randint(0, 512, (8, 33), generator=torch.Generator().manual_seed(step))
        train_step(r, batch[rank * 4 : (rank + 1) * 4], 3e-3)
        measured.append(group.stats.take().get(f"{group.name}/all_gather", 0))
        for module, weight in seen:
            want = WeightGather().round_trip(whole[id(module.weight)])
            forwards += 1
            if not torch.equal(weight, want):
                mismatched.append((step, layers[module]))
        # two gathers per block bucket a micro-batch (forward, backward), the root's once
        expected.append(sum(closed_form_bytes(f, fp8_ids) * gathers_per_step(r, f)
                            for f in r.optimizer.flats))
    return {"mismatched": mismatched, "forwards": forwards, "measured": measured,
            "expected": expected,
            "fp8_buckets": sum(f.fp8 is not None for f in r.optimizer.flats),
            "fp8_vs_dtype": [(closed_form_bytes(f, fp8_ids), closed_form_bytes(f, set()))
                             for f in r.optimizer.flats if f.fp8 is not None]}


def gathers_per_step(r, flat) -> int:
    """A block's bucket is gathered for each micro-batch's forward and backward; the root
    unit (embedding, final norm, output layer) once per micro-batch."""
    units = r.optimizer.units
    micro_batches = r.plan.micro_batches
    root = units.unit_of_bucket[flat.bucket.index] == units.root
    return micro_batches * (1 if root else 2)


@pytest.mark.slow
def test_zero3_gathers_fp8_weights_bit_for_bit_in_closed_form_bytes():
    """Every forward of every low-precision layer under dp=2 ZeRO-3 (MXFP8, tensor-wise FP8)
    sees exactly round_trip(whole weight); the gathers' bytes are the closed form."""
    results = run_distributed(gather_runs, 2)
    for rank, fp8, got in [(r, f, g) for r, runs in enumerate(results) for f, g in runs.items()]:
        assert got["fp8_buckets"] == 1, got  # block 1's bucket; block 0 is kept in bf16
        assert got["forwards"] == STEPS * 2 * 5, got  # 2 micro-batches x 5 layers of block 1
        assert not got["mismatched"], (rank, fp8, got["mismatched"])
        assert got["measured"] == got["expected"], (rank, fp8, got)
        for fp8_bytes, bf16_bytes in got["fp8_vs_dtype"]:  # E4M3 weights, bf16 norms
            assert 0.5 < fp8_bytes / bf16_bytes < 0.51, got["fp8_vs_dtype"]


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
