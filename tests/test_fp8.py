"""FP8: format bounds, the three scaling recipes, fp8_linear against references computed by hand
from the quantised tensors, and its torch._scaled_mm path against its emulated path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.errors import MeshtronError
from meshtron.precision.fp8 import (
    E4M3,
    E5M2,
    BlockwiseScaling,
    DelayedScaling,
    FP8Format,
    TensorwiseScaling,
    check_blockwise_shapes,
    dequantize,
    fp8_linear,
    make_recipe,
    quantize,
    quantize_operand,
    scaled_mm_by_default,
    scaled_mm_supported,
    tile_amax,
)

HALF_ULP = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
"""Relative rounding error bound of normal values: half an ulp, 3 and 2 mantissa bits."""


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_within_bound(x: torch.Tensor, xd: torch.Tensor, scale: torch.Tensor,
                         fmt: FP8Format) -> None:
    """Normal values within half an ulp relatively; subnormals within half the spacing."""
    finfo = torch.finfo(fmt.dtype)
    scaled = (x * scale).abs()
    err = (xd - x).abs()
    normal = scaled >= finfo.smallest_normal
    assert normal.float().mean() > 0.9  # the bound is checked on most values
    tol = 1 + 1e-6  # fp32 rounding of x * scale and of the division
    assert (err[normal] <= HALF_ULP[fmt.name] * x.abs()[normal] * tol).all()
    spacing = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}[fmt.name]
    assert (err[~normal] * scale.expand_as(x)[~normal] <= spacing / 2 * tol).all()


def _qdq(t: torch.Tensor, fmt: FP8Format, scale: torch.Tensor) -> torch.Tensor:
    """Reference quantise-dequantise written out with torch ops."""
    return (t * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype).float() / scale


def _ref_tensorwise(t: torch.Tensor, fmt: FP8Format, amax: torch.Tensor | None = None
                    ) -> torch.Tensor:
    amax = t.abs().max() if amax is None else amax
    return _qdq(t.float(), fmt, fmt.max / amax)


def _ref_tiles(t: torch.Tensor, fmt: FP8Format, rows: int, cols: int) -> torch.Tensor:
    """Reference per-tile quantise-dequantise of a 2-D tensor; pads a ragged edge with zeros."""
    r, c = t.shape
    p = F.pad(t.float(), (0, -c % cols, 0, -r % rows))
    tiles = p.reshape(p.shape[0] // rows, rows, p.shape[1] // cols, cols)
    scale = fmt.max / tiles.abs().amax(dim=(1, 3), keepdim=True)
    return _qdq(tiles, fmt, scale).reshape(p.shape)[:r, :c]


# ---------------------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_round_trip_error_is_within_the_format_bound(fmt):
    x = torch.randn(64, 64, generator=_gen()) * torch.exp(torch.randn(64, 64, generator=_gen(1)))
    scale, _ = TensorwiseScaling().scales(x, "input", fmt)
    assert torch.equal(scale, fmt.max / x.abs().max())
    q, s = quantize(x, fmt, scale)
    assert q.dtype == fmt.dtype and q.float().abs().max() == fmt.max
    _assert_within_bound(x, dequantize(q, s), scale, fmt)


def test_saturation_clamps_to_the_format_max_and_non_finite_stays_visible():
    x = torch.tensor([1000.0, -1e9, 3.0, float("inf"), float("nan")])
    assert quantize(x, E4M3, 1.0)[0].float()[:3].tolist() == [448.0, -448.0, 3.0]
    q5 = quantize(x * 100, E5M2, 1.0)[0].float()
    assert q5[:2].tolist() == [57344.0, -57344.0]  # the plain cast would give inf
    assert q5[3:].isnan().all() and quantize(x, E4M3, 1.0)[0].float()[3:].isnan().all()


def test_zero_tensor_gets_scale_one():
    scale, _ = TensorwiseScaling().scales(torch.zeros(4, 4), "input", E4M3)
    assert scale.item() == 1.0
    assert (BlockwiseScaling(block=2).scales(torch.zeros(4, 4), "weight", E4M3)[0] == 1).all()


def test_tile_amax_handles_a_ragged_last_tile():
    x = torch.arange(30.0).reshape(5, 6)
    assert tile_amax(x, (2, 4)).tolist() == [[9.0, 11.0], [21.0, 23.0], [27.0, 29.0]]


# ------------------------------------------------------------------------------- blockwise


def test_blockwise_keeps_an_outlier_from_destroying_the_rest():
    x = torch.randn(16, 64, generator=_gen())
    x[3, 5] = 1e6
    others = torch.ones_like(x, dtype=torch.bool)
    others[3, 5] = False

    tensorwise = quantize_operand(x, "input", TensorwiseScaling(), E4M3).dequantize()
    assert (tensorwise[others] == 0).float().mean() > 0.9  # nearly all underflow to zero
    rel = ((tensorwise - x).abs() / x.abs())[others]
    assert rel.median() == 1.0

    recipe = BlockwiseScaling(block=16)
    blockwise = quantize_operand(x, "input", recipe, E4M3)
    assert blockwise.scale.shape == (16, 4)
    clean = torch.ones_like(others)
    clean[3, :16] = False  # the tile holding the outlier
    scale = recipe.scales(x, "input", E4M3)[0].repeat_interleave(16, dim=1)
    _assert_within_bound(x[clean], blockwise.dequantize()[clean], scale[clean], E4M3)

    w = torch.randn(32, 32, generator=_gen(2))
    w[0, 0] = 1e6
    qw = quantize_operand(w, "weight", BlockwiseScaling(block=8), E4M3)
    assert qw.scale.shape == (4, 4)
    wscale = qw.scale.repeat_interleave(8, 0).repeat_interleave(8, 1)
    _assert_within_bound(w[8:], qw.dequantize()[8:], wscale[8:], E4M3)


def test_blockwise_shape_check_raises_a_clear_error():
    check_blockwise_shapes(256, 384)
    with pytest.raises(MeshtronError, match=r"divisible by the block size 128, got "
                       r"in_features=100, out_features=256; pad the model or use tensorwise"):
        check_blockwise_shapes(100, 256)
    x, w = torch.randn(3, 12), torch.randn(8, 12)
    with pytest.raises(MeshtronError, match="in_features divisible by the block size 8, got 12"):
        fp8_linear(x, w, None, BlockwiseScaling(block=8))


# ------------------------------------------------------------------------------ fp8_linear


def _run(recipe, x, w, b, gy, grad_format="e5m2", gemm=None):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = fp8_linear(x, w, b, recipe, grad_format, gemm=gemm)
    y.backward(gy)
    return y, x.grad, w.grad, b.grad


def _inputs(seed=0, lead=(2, 3), n_in=16, n_out=8):
    g = _gen(seed)
    return (torch.randn(*lead, n_in, generator=g), torch.randn(n_out, n_in, generator=g),
            torch.randn(n_out, generator=g), torch.randn(*lead, n_out, generator=g))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to fp32 matmul rounding."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    atol = 1e-6 * b.abs().max().item()
    assert torch.allclose(a, b, rtol=1e-6, atol=atol), (a - b).abs().max().item()


@pytest.mark.parametrize("grad_format", ["e5m2", "e4m3"])
def test_tensorwise_linear_matches_the_hand_computed_reference(grad_format):
    x, w, b, gy = _inputs()
    y, gx, gw, gb = _run(TensorwiseScaling(), x, w, b, gy, grad_format)
    gfmt = E5M2 if grad_format == "e5m2" else E4M3
    x2, gy2 = x.reshape(-1, 16), gy.reshape(-1, 8)
    xq, wq, gyq = _ref_tensorwise(x2, E4M3), _ref_tensorwise(w, E4M3), _ref_tensorwise(gy2, gfmt)
    _close(y, (xq @ wq.t() + b).reshape(2, 3, 8))
    _close(gx, (gyq @ wq).reshape(2, 3, 16))
    _close(gw, gyq.t() @ xq)
    _close(gb, gy2.sum(0))


def test_blockwise_linear_matches_the_hand_computed_reference():
    x, w, b, gy = _inputs()  # 6 tokens: a ragged 4 x 1 tile along tokens for the wgrad operands
    y, gx, gw, gb = _run(BlockwiseScaling(block=4), x, w, b, gy)
    x2, gy2 = x.reshape(-1, 16), gy.reshape(-1, 8)
    xq, wq, gyq = _ref_tiles(x2, E4M3, 1, 4), _ref_tiles(w, E4M3, 4, 4), _ref_tiles(gy2, E5M2, 1, 4)
    xq_t, gyq_t = _ref_tiles(x2, E4M3, 4, 1), _ref_tiles(gy2, E5M2, 4, 1)
    _close(y, (xq @ wq.t() + b).reshape(2, 3, 8))
    _close(gx, (gyq @ wq).reshape(2, 3, 16))
    _close(gw, gyq_t.t() @ xq_t)
    _close(gb, gy2.sum(0))


def test_delayed_linear_uses_the_previous_steps_amax():
    recipe = DelayedScaling(history_len=4)
    x1, w, b, gy1 = _inputs(0)
    x2, _, _, gy2 = _inputs(1)
    y1, gx1, _, _ = _run(recipe, x1, w, b, gy1)  # first use: current scaling
    wq = _ref_tensorwise(w, E4M3)
    _close(y1, _ref_tensorwise(x1, E4M3) @ wq.t() + b)
    _close(gx1, _ref_tensorwise(gy1, E5M2) @ wq)
    y2, gx2, gw2, _ = _run(recipe, x2, w, b, gy2)
    xq = _ref_tensorwise(x2, E4M3, amax=x1.abs().max())
    gyq = _ref_tensorwise(gy2, E5M2, amax=gy1.abs().max())
    _close(y2, xq @ wq.t() + b)
    _close(gx2, gyq @ wq)
    _close(gw2, gyq.reshape(-1, 8).t() @ xq.reshape(-1, 16))
    assert recipe.seen == {"input": 2, "weight": 2, "grad_output": 2}


@pytest.mark.parametrize("name", ["tensorwise", "delayed", "blockwise"])
def test_fp8_linear_is_close_to_the_fp32_linear(name):
    x, w, b, gy = _inputs(3, lead=(4, 8), n_in=64, n_out=32)
    recipe = make_recipe(name, block=16) if name == "blockwise" else make_recipe(name)
    ref = _run_fp32(x, w, b, gy)
    for step in range(2):  # the second step exercises the delayed history
        got = _run(recipe, x, w, b, gy)
        for a, r, tol in zip(got, ref, (0.06, 0.1, 0.1, 1e-6), strict=True):
            rel = (torch.linalg.norm(a - r) / torch.linalg.norm(r)).item()
            assert rel < tol, (name, step, rel)


def _run_fp32(x, w, b, gy):
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = F.linear(x, w, b)
    y.backward(gy)
    return y, x.grad, w.grad, b.grad


def test_shapes_and_dtypes_follow_the_inputs():
    x, w, b, gy = (t.bfloat16() for t in _inputs(lead=(5,)))
    w.requires_grad_()
    y = fp8_linear(x, w, None, TensorwiseScaling())
    assert y.shape == (5, 8) and y.dtype == torch.bfloat16
    y.backward(gy)
    assert w.grad.shape == w.shape and w.grad.dtype == torch.bfloat16 and x.grad is None
    x4 = torch.randn(2, 1, 3, 16, requires_grad=True)
    fp8_linear(x4, w.detach(), b, TensorwiseScaling()).sum().backward()
    assert x4.grad.shape == x4.shape and x4.grad.dtype == torch.float32


def test_autocast_does_not_lower_the_fp32_products():
    x, w, b, gy = _inputs()
    plain = fp8_linear(x, w, b, TensorwiseScaling())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = fp8_linear(x, w, b, TensorwiseScaling())
    assert autocast.dtype == torch.float32 and torch.equal(plain, autocast)


def test_fp8_linear_is_deterministic():
    x, w, b, gy = _inputs(lead=(6,), n_in=16, n_out=8)
    for recipe in (TensorwiseScaling, lambda: BlockwiseScaling(block=4)):
        first, second = _run(recipe(), x, w, b, gy), _run(recipe(), x, w, b, gy)
        assert all(torch.equal(a, c) for a, c in zip(first, second, strict=True))


def test_deferred_weight_gradient_is_handed_to_the_hook():
    x, w, b, gy = _inputs()
    _, _, gw_ref, _ = _run(TensorwiseScaling(), x, w, b, gy)
    taken = []
    wp = w.clone().requires_grad_()
    y = fp8_linear(x, wp, b, TensorwiseScaling(), defer=lambda *p: taken.append(p) or True)
    y.backward(gy)
    assert wp.grad is None and len(taken) == 1
    weight, xq, gyq = taken[0]
    assert weight is wp
    _close(gyq.t() @ xq, gw_ref)


# ------------------------------------------------------------------------- delayed and tp


def test_delayed_history_updates_and_reduction_knobs():
    amaxes = [1.0, 4.0, 2.0, 0.5]
    expected = {"max": [1.0, 1.0, 4.0, 4.0], "most_recent": [1.0, 1.0, 4.0, 2.0]}
    for reduction, used in expected.items():
        recipe = DelayedScaling(history_len=2, reduction=reduction)
        for amax, u in zip(amaxes, used, strict=True):
            scale, _ = recipe.scales(torch.tensor([amax, -amax / 3]), "weight", E4M3)
            assert scale.item() == pytest.approx(448.0 / u)
        assert recipe.history["weight"].tolist() == [0.5, 2.0]  # most recent first
        assert recipe.seen["weight"] == 2 and "input" not in recipe.history
    margin = DelayedScaling(margin=1)
    assert margin.scales(torch.tensor([2.0]), "input", E4M3)[0].item() == 112.0

    recipe = DelayedScaling(history_len=3)
    recipe.scales(torch.tensor([1.0]), "input", E4M3)
    q = quantize_operand(torch.tensor([4.0, 0.5]), "input", recipe, E4M3)  # amax jumped 4x
    assert q.data.float().tolist() == [448.0, 224.0]  # saturates
    restored = DelayedScaling(history_len=3)
    restored.load_state_dict(recipe.state_dict())
    assert torch.equal(restored.scales(torch.tensor([9.0]), "input", E4M3)[0],
                       recipe.scales(torch.tensor([9.0]), "input", E4M3)[0])
    with pytest.raises(MeshtronError, match="reduction must be"):
        DelayedScaling(reduction="mean")


@pytest.mark.parametrize("cls", [TensorwiseScaling, DelayedScaling])
def test_reduce_amax_is_called_with_the_amax_and_its_result_used(cls):
    calls = []

    def reduce_amax(amax):
        calls.append(amax.clone())
        return amax * 2

    recipe = cls(reduce_amax=reduce_amax)
    x = torch.tensor([[1.0, -3.0], [2.0, 0.5]])
    q = quantize_operand(x, "input", recipe, E4M3)
    assert [c.item() for c in calls] == [3.0]
    assert q.scale.item() == pytest.approx(448.0 / 6) and q.data.float().abs().max() == 224.0
    if cls is DelayedScaling:
        assert recipe.history["input"][0].item() == 6.0


def test_column_parallel_split_equals_the_unsplit_layer():
    """Two simulated tp ranks, output features split; amax agreed by a fake all-reduce-max."""
    x, w, b, gy = _inputs(lead=(6,), n_in=16, n_out=8)
    shards = [slice(0, 4), slice(4, 8)]
    for name in ("tensorwise", "blockwise"):
        full = _run(make_recipe(name, **_knobs(name, x, w, gy, None)), x, w, b, gy)
        parts = [_run(make_recipe(name, **_knobs(name, x, w, gy, s)), x, w[s], b[s], gy[:, s])
                 for s in shards]
        _close(torch.cat([p[0] for p in parts], -1), full[0])
        _close(sum(p[1] for p in parts), full[1])  # the tp all-reduce of grad_x
        _close(torch.cat([p[2] for p in parts]), full[2])


def test_row_parallel_split_equals_the_unsplit_layer():
    """Two simulated tp ranks, input features split; partial outputs summed, bias added once."""
    x, w, b, gy = _inputs(lead=(6,), n_in=16, n_out=8)
    shards = [slice(0, 8), slice(8, 16)]
    zero = torch.zeros_like(b)
    for name in ("tensorwise", "blockwise"):
        full = _run(make_recipe(name, **_knobs(name, x, w, gy, None)), x, w, zero, gy)
        parts = [_run(make_recipe(name, **_knobs(name, x, w, gy, s)), x[:, s], w[:, s], zero, gy)
                 for s in shards]
        _close(sum(p[0] for p in parts), full[0])  # the tp all-reduce of y
        _close(torch.cat([p[1] for p in parts], -1), full[1])
        _close(torch.cat([p[2] for p in parts], -1), full[2])


def _knobs(name, x, w, gy, shard):
    if name == "blockwise":
        return {"block": 4}
    # call order: input, weight (forward), grad_output (backward); max with the other ranks'
    agreed = iter([x.abs().max(), w.abs().max(), gy.abs().max()])
    return {"reduce_amax": lambda a: torch.maximum(a, next(agreed))}


# ------------------------------------------------------------------------------ gemm paths


def _count_scaled_mm(monkeypatch) -> list[tuple]:
    """Record the operand dtypes of every torch._scaled_mm call."""
    calls, real = [], torch._scaled_mm

    def counting(a, b, **kwargs):
        calls.append((a.dtype, b.dtype))
        return real(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


def _assert_paths_agree(got, ref) -> None:
    """The scaled_mm path equals the emulated one up to fp32 rounding (inverse scales
    multiplied instead of divided, another summation order)."""
    for a, r in zip(got, ref, strict=True):
        assert a.shape == r.shape and a.dtype == r.dtype
        assert torch.allclose(a, r, rtol=1e-5, atol=1e-6 * r.abs().max().item()), (
            (a - r).abs().max().item())


@pytest.mark.parametrize("name", ["tensorwise", "delayed"])
@pytest.mark.parametrize("shape", [((4, 8), 64, 48), ((3, 5), 20, 12)], ids=["x16", "ragged"])
@pytest.mark.parametrize("grad_format", ["e5m2", "e4m3"])
def test_scaled_mm_path_equals_the_emulated_path(name, shape, grad_format, monkeypatch):
    lead, n_in, n_out = shape
    calls = _count_scaled_mm(monkeypatch)
    recipes = {gemm: make_recipe(name) for gemm in ("scaled_mm", "emulated")}
    for step in range(2):  # the second step scales from the delayed history
        x, w, b, gy = _inputs(step, lead, n_in, n_out)
        ref = _run(recipes["emulated"], x, w, b, gy, grad_format, gemm="emulated")
        assert len(calls) == 3 * step
        got = _run(recipes["scaled_mm"], x, w, b, gy, grad_format, gemm="scaled_mm")
        _assert_paths_agree(got, ref)
    gfmt = E5M2.dtype if grad_format == "e5m2" else E4M3.dtype
    e4m3 = E4M3.dtype
    assert calls == [(e4m3, e4m3), (gfmt, e4m3), (gfmt, e4m3)] * 2  # y, grad_x, grad_W
    if name == "delayed":
        assert recipes["scaled_mm"].history.keys() == recipes["emulated"].history.keys()
        for role, h in recipes["emulated"].history.items():
            assert torch.equal(recipes["scaled_mm"].history[role], h)


def test_gemm_knob_on_the_recipe_and_its_default(monkeypatch):
    calls = _count_scaled_mm(monkeypatch)
    x, w, b, gy = _inputs()
    _run(TensorwiseScaling(), x, w, b, gy)  # "auto" on CPU: emulated (the kernel is slow)
    assert len(calls) == 0
    _run(TensorwiseScaling(gemm="scaled_mm"), x, w, b, gy)  # torch's CPU kernel, when asked
    assert len(calls) == 3
    _run(make_recipe("delayed", gemm="emulated"), x, w, b, gy)
    _run(BlockwiseScaling(block=4), x, w, b, gy)  # block-wise scales: always emulated
    _run(TensorwiseScaling(gemm="scaled_mm"), x, w, b, gy, gemm="emulated")  # the call wins
    assert len(calls) == 3
    with pytest.raises(MeshtronError, match="blockwise scaling has no scaled_mm path"):
        make_recipe("blockwise", gemm="scaled_mm")
    with pytest.raises(MeshtronError, match="cannot multiply block-wise scales"):
        _run(BlockwiseScaling(block=4), x, w, b, gy, gemm="scaled_mm")
    with pytest.raises(MeshtronError, match="unknown fp8 gemm 'cublas'"):
        TensorwiseScaling(gemm="cublas")


def test_scaled_mm_support_rules(monkeypatch):
    e4, e5 = E4M3.dtype, E5M2.dtype
    assert scaled_mm_supported(torch.device("cpu"), e5, e5, 3, 7, 5)
    assert not scaled_mm_supported(torch.device("meta"), e4, e4, 16, 16, 16)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, ok in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, c=capability: c)
        assert scaled_mm_supported(cuda, e5, e4, 8, 64, 32) is ok
    assert scaled_mm_supported(cuda, e4, e5, 8, 64, 32)
    assert not scaled_mm_supported(cuda, e5, e5, 8, 64, 32)
    assert not scaled_mm_supported(cuda, e4, e4, 8, 20, 32)  # k not a multiple of 16
    assert not scaled_mm_supported(cuda, e4, e4, 8, 64, 24)  # n not a multiple of 16
    # "auto" takes _scaled_mm only where it is a native GEMM: not torch's CPU kernel
    assert not scaled_mm_by_default(torch.device("cpu"), e4, e4, 16, 16, 16)
    assert scaled_mm_by_default(cuda, e4, e4, 8, 64, 32)
    assert not scaled_mm_by_default(cuda, e4, e4, 8, 20, 32)


@pytest.mark.parametrize("name", ["tensorwise", "delayed"])
def test_deferred_weight_gradient_under_scaled_mm(name, monkeypatch):
    calls = _count_scaled_mm(monkeypatch)
    x, w, b, gy = _inputs()
    _, _, gw_ref, _ = _run(make_recipe(name), x, w, b, gy, gemm="scaled_mm")
    taken = []
    for take in (True, False):
        wp = w.clone().requires_grad_()
        hook = lambda *p, take=take: taken.append(p) or take  # noqa: E731
        fp8_linear(x, wp, b, make_recipe(name), gemm="scaled_mm", defer=hook).backward(gy)
        if take:
            assert wp.grad is None
        else:
            _close(wp.grad, gw_ref)
    assert len(calls) == 3 + 1 + 2  # x needs no grad here; the deferred product is the hook's
    weight, xq, gyq = taken[0]
    assert xq.dtype == gyq.dtype == torch.float32 and xq.shape == (6, 16)
    _assert_paths_agree([gyq.t() @ xq], [gw_ref])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scaled_mm_on_cuda_is_close_to_the_emulated_path():
    """On sm89+ the products run on FP8 tensor cores; cuBLAS sums in another order (and
    Hopper keeps fewer accumulator bits between promotions), hence a norm-wise tolerance."""
    if not scaled_mm_supported(torch.device("cuda"), E5M2.dtype, E4M3.dtype, 16, 16, 16):
        pytest.skip("this GPU has no FP8 _scaled_mm")
    x, w, b, gy = (t.cuda() for t in _inputs(lead=(4, 32), n_in=256, n_out=128))
    for name in ("tensorwise", "delayed"):
        ref = _run(make_recipe(name), x, w, b, gy, gemm="emulated")
        got = _run(make_recipe(name), x, w, b, gy, gemm="scaled_mm")
        for a, r in zip(got, ref, strict=True):
            assert (torch.linalg.norm(a - r) / torch.linalg.norm(r)).item() < 1e-4, name
