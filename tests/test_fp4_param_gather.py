"""precision.fp8_param_gather with precision.fp4=nvfp4: ZeRO-3 gathers the NVFP4 layers'
weights as E2M1 nibbles, two to a byte, at the whole weight's scales (agreed from tile amaxes,
never sent), and each layer computes with exactly the single NVFP4 quantisation of its whole
weight, as one process does (tests/test_low_precision_training.py runs the layout beside the
others against one process)."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.optim.fp8_gather import FP8Gather
from meshtron.optim.grad_buckets import Bucket
from meshtron.parallel.mesh import MeshLayout, ParallelMesh
from meshtron.parallel.mesh.groups import CommStats, Group
from meshtron.plan import plan_run
from meshtron.precision.fp4_gather import encode_run, pack_nibbles, run_tile_amax, unpack_nibbles
from meshtron.precision.nvfp4 import (
    NVFP4_BLOCK,
    WEIGHT_TILE,
    NVFP4Options,
    nvfp4_block_scales,
    nvfp4_encode,
    nvfp4_quantize,
    nvfp4_weight,
    per_tensor_scale,
)
from meshtron.precision.param_gather import FP4WeightGather
from meshtron.rank import amax_agreement, build_rank
from meshtron.training.step import train_step
from tests.distributed import run_distributed
from tests.test_fp8_param_gather import (
    MODEL,
    count_gathers,
    full_weights,
    gathered_bytes,
    sent_bytes,
)

STEPS = 2
CUT = ("--model.ffn_hidden_size=144",)
"""Block 1's bucket then holds 43 x 1024 elements: dp=2 cuts the gate/up weight [288, 64] at
row 200, through a band of 16 x 16 tiles (rows 192..207 split 8 / 8 between the ranks)."""
FP32 = ("--precision.dtype=fp32",)
"""fp32 parameters: the gathered weight quantised again would be an ulp off (bf16 ones, whose
amax a bf16 buffer holds exactly, happen to quantise back to themselves)."""


def closed_form_bytes(flat, fp4_ids: set[int]) -> int:
    """Bytes one rank sends per gather of ``flat``: (d - 1) x the longest rank's pack, a pack
    holding each NVFP4 weight's run as ceil(n / 2) bytes, any other element in its dtype."""
    return gathered_bytes(flat, lambda n: (n + 1) // 2, fp4_ids)


def amax_bytes(flat) -> int:
    """The amax all-reduce's bytes per quantisation: one fp32 per 16 x 16 tile of every
    NVFP4 weight, 2 (d - 1) / d of it on the wire (ring)."""
    tiles = sum(flat.bucket.shapes[i].numel() // NVFP4_BLOCK**2 for i in flat.fp8.weights)
    d = flat.group.size
    return 2 * tiles * 4 * (d - 1) // d


def count_amax_bytes(flats) -> list[int]:
    """Bytes the dp group's all-reduces record while each bucket forms its pack, per pack
    formed (a pack reused until the shard changes sends none)."""
    out: list[int] = []
    for flat in (f for f in flats if f.fp8 is not None):
        def pack(shard, start, flat=flat, original=flat.fp8.pack):
            key = f"{flat.group.name}/all_reduce"
            before = flat.group.stats.bytes.get(key, 0)
            result = original(shard, start)
            if flat.group.stats.bytes.get(key, 0) != before:
                out.append(flat.group.stats.bytes[key] - before)
            return result
        flat.fp8.pack = pack
    return out


def tile_cuts(flat, seg) -> list[int]:
    """The ends of ``seg`` (a run of an NVFP4 weight) that fall inside a band of 16 rows of
    the weight, i.e. through its tiles."""
    first, shape = flat.fp8._first(seg)
    band = NVFP4_BLOCK * shape[1]
    return [at for at in (first, first + seg.end - seg.start)
            if 0 < at < shape.numel() and at % band]


def fp4_run(rank: int, world_size: int, tp: int = 1, knobs: tuple[str, ...] = ()) -> dict:
    cfg = load_config(overrides=MODEL + ["--precision.fp4=nvfp4", f"--parallel.tp={tp}",
                                         "--precision.fp8_param_gather=true", *knobs])
    mesh = ParallelMesh(MeshLayout.of(cfg.parallel, world_size), rank)
    agreed = NVFP4Options(reduce_amax=amax_agreement(mesh))  # the whole weight's amax under tp
    r = build_rank(plan_run(cfg, world_size), mesh)
    if mesh.tp.rank == 1:  # tp slices 64x apart: a slice's own scale is not the weight's
        for flat, master in zip(r.optimizer.flats, r.optimizer.adamw.master):
            master.mul_(64.0)
            if master is not flat.shard:
                flat.shard.mul_(64.0)
    layers = {m: name for name, m in r.model.named_modules() if getattr(m, "fp8", None)}
    seen: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []
    for module in layers:
        module.register_forward_pre_hook(lambda m, args: seen.append(
            (m, nvfp4_weight(m.weight, m.fp8).dequantize(), m.weight.detach().clone())))
    launched = count_gathers(r.optimizer.flats)
    reduced = count_amax_bytes(r.optimizer.flats)
    groups = {f.group.name: f.group for f in r.optimizer.flats}
    fp4_ids = {id(m.weight) for m in layers}
    mismatched, measured, expected = [], [], []
    for step in range(STEPS):
        whole = full_weights(r)
        seen.clear()
        launched.clear()
        sent_bytes(groups)
        batch = torch.randint(0, 512, (8, 33), generator=torch.Generator().manual_seed(step))
        dp = mesh.dp.rank
        train_step(r, batch[dp * 4 : (dp + 1) * 4], 3e-3)
        measured.append(sent_bytes(groups))
        for module, operand, held in seen:
            want = agreed.quantize(whole[id(module.weight)], "weight", WEIGHT_TILE).dequantize()
            if not (torch.equal(operand, want) and torch.equal(held, want.to(held.dtype))):
                mismatched.append((step, layers[module]))
        expected.append(sum(closed_form_bytes(f, fp4_ids) * launched[f.bucket.index]
                            for f in r.optimizer.flats))
    fp4_flats = [f for f in r.optimizer.flats if f.fp8 is not None]
    return {"mismatched": mismatched, "forwards": len(seen), "layers": len(layers),
            "measured": measured, "expected": expected, "amax_bytes": reduced,
            "amax_expected": [amax_bytes(f) for f in fp4_flats] * STEPS,
            "cuts": [cut for f in fp4_flats for segs in f.fp8.segments for s in segs if s.fp4
                     for cut in tile_cuts(f, s)],
            "fp4_vs_dtype": [(closed_form_bytes(f, fp4_ids), closed_form_bytes(f, set()))
                             for f in fp4_flats]}


@pytest.mark.slow
def test_zero3_gathers_nvfp4_weights_as_the_single_quantisation_in_closed_form_bytes():
    """dp=2 ZeRO-3, block 1 in NVFP4: at every forward of every NVFP4 layer over 2 steps, the
    weight it computes with is bit for bit the single NVFP4 quantisation of the whole weight
    assembled from the shards (and the gathered buffer holds it); the all-gathers' bytes are
    the closed form (half a byte per NVFP4 element), the amax all-reduce one fp32 per tile."""
    for rank, got in enumerate(run_distributed(fp4_run, 2, 1, CUT)):
        assert got["forwards"] == 2 * got["layers"] > 0, got  # 2 micro-batches, last step
        assert not got["mismatched"], (rank, got["mismatched"])
        assert got["measured"] == got["expected"], (rank, got)
        assert got["amax_bytes"] == got["amax_expected"], (rank, got)
        assert got["cuts"], got  # a shard boundary runs through a tile
        (fp4_bytes, bf16_bytes), = got["fp4_vs_dtype"]
        assert 0.25 <= fp4_bytes / bf16_bytes < 0.26, got


@pytest.mark.slow
def test_zero3_fp4_gather_agrees_the_per_tensor_scale_over_tp():
    """tp=2 x dp=2 with the tp slices 64x apart: the per-tensor scale is the whole weight's
    (its slices' amaxes agreed), the tile scales the slice's: still bit for bit. In fp32, where
    quantising the gathered weight again would move it (the per-tensor scale formed again
    from its amax is an ulp off), so the layer must take it as is."""
    for rank, got in enumerate(run_distributed(fp4_run, 4, 2, FP32)):
        assert got["forwards"] == 2 * got["layers"] > 0, got
        assert not got["mismatched"], (rank, got["mismatched"])
        assert got["measured"] == got["expected"], (rank, got)


def test_nvfp4_round_trip_is_not_idempotent_so_the_gathered_weight_is_taken_as_is():
    """Quantising NVFP4's dequantised weight again moves it (a block whose largest code is 4
    gets a smaller scale); runs cut anywhere through the tiles,
    their tile amaxes maxed, encode and pack to the whole weight's codes; the layer given
    the gathered scales computes with the single quantisation."""
    g = torch.Generator().manual_seed(14)  # a weight whose round trip moves
    w = torch.randn(32, 48, generator=g)
    w = (w * torch.exp2(torch.randint(-3, 3, (2, 3), generator=g).float()).repeat_interleave(
        16, 0).repeat_interleave(16, 1)).bfloat16()
    opts = NVFP4Options()
    once = opts.quantize(w, "weight", WEIGHT_TILE)
    deq = once.dequantize()
    assert not torch.equal(opts.quantize(deq, "weight", WEIGHT_TILE).dequantize(), deq)
    cuts, flat = [0, 7, 300, 801, 1536], w.reshape(-1)
    tiles = torch.stack([run_tile_amax(flat[a:b], a, w.shape)
                         for a, b in zip(cuts, cuts[1:])]).amax(0)
    tensor = per_tensor_scale(tiles.max())
    scale8 = nvfp4_block_scales(tiles, tensor)
    assert torch.equal(scale8.float(), once.block_scale.float())
    codes = torch.cat([unpack_nibbles(pack_nibbles(encode_run(flat[a:b], a, w.shape, scale8,
                                                              tensor)), b - a)
                       for a, b in zip(cuts, cuts[1:])])
    assert torch.equal(codes.view(w.shape), once.codes)
    gather = FP4WeightGather()
    opts = NVFP4Options(gather=gather)
    held = deq.bfloat16()
    gather.deliver(held, scale8, tensor)
    assert torch.equal(nvfp4_weight(held, opts).dequantize(), deq)
    other = held.clone()  # not the delivered buffer: quantised from its own values
    assert torch.equal(nvfp4_weight(other, opts).dequantize(),
                       NVFP4Options().quantize(other, "weight", WEIGHT_TILE).dequantize())
    assert torch.equal(nvfp4_encode(w, scale8, tensor, WEIGHT_TILE).codes,
                       nvfp4_quantize(w, tensor, WEIGHT_TILE).codes)


def test_nibbles_pack_the_even_element_low_and_pad_an_odd_run():
    codes = torch.tensor([1, 15, 8, 3, 7], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [0xF1, 0x38, 0x07]
    assert torch.equal(unpack_nibbles(packed, 5), codes)


def one_rank_gather(weight: torch.Tensor) -> tuple[FP8Gather, FP4WeightGather]:
    """The packing of a one-rank bucket holding a norm-like vector and ``weight``."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(weight)]
    group = Group("dp", [0], 0, None, CommStats())
    bucket = Bucket(0, params, [0, 3], [p.shape for p in params], 3 + weight.numel(),
                    4 + weight.numel(), True, 1, group)
    gather = FP4WeightGather()
    return FP8Gather(bucket, {id(params[1]): gather}), gather


def test_one_rank_pack_unpacks_to_the_single_quantisation_and_a_nan_is_one_line():
    """A bucket's pack (a 3-element vector in fp32 then the weight's nibbles) unpacks to the
    vector and the weight's single quantisation, whose scales reach the layer; a weight
    holding a NaN is refused in one line, as the layer refuses it."""
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(3))
    packing, gather = one_rank_gather(w)
    shard = torch.cat([torch.full((3,), 2.0), w.reshape(-1), torch.zeros(1)])
    assert packing.length == 3 * 4 + w.numel() // 2
    full = torch.empty_like(shard)
    packing.unpack(packing.gather_buffer(shard, 0), full)
    want = NVFP4Options().quantize(w, "weight", WEIGHT_TILE).dequantize()
    assert torch.equal(full[:3], shard[:3]) and full[-1] == 0
    held = full[3:-1].view(w.shape)
    assert torch.equal(held, want)
    assert torch.equal(nvfp4_weight(held, NVFP4Options(gather=gather)).dequantize(), want)
    shard[40] = float("nan")
    with pytest.raises(MeshtronError, match="non-finite amax .* weight") as info:
        packing.pack(shard, 0)
    assert "\n" not in str(info.value)
