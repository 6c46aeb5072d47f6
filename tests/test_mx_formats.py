"""MXFP8 and NVFP4 against torchao, the PyTorch team's low-precision library, as the outside
reference: every element and every scale equal, for random, zero, subnormal, huge and
non-finite inputs; the MXFP8 linear layer's output and gradients equal to torchao's emulated
``mx_mm``; NVFP4's stochastic rounding deterministic, layout-independent and unbiased; bad
shapes and non-finite amaxes refused in one line."""

from __future__ import annotations

import pytest
import torch

from meshtron.errors import MeshtronError
from meshtron.precision.fp8 import E4M3, E5M2, fp8_linear
from meshtron.precision.mx import MXScaling, mx_dequantize, mx_quantize
from meshtron.precision.nvfp4 import (
    NVFP4Options,
    e2m1_codes,
    e2m1_values,
    hadamard16,
    hadamard_signs,
    nvfp4_linear,
    nvfp4_quantize,
    per_tensor_scale,
    rht_along_rows,
)

try:  # the outside reference; `make setup` installs it (--no-deps, beside the CPU torch)
    import torchao.prototype.mx_formats.mx_tensor as mx_tensor
except ImportError as missing:
    raise ImportError("torchao is missing: run `make setup` (or .venv/bin/pip install "
                      "--no-deps torchao==0.18.0)") from missing
from torchao.prototype.moe_training.mxfp8_linear import mx_mm  # noqa: E402
from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import (  # noqa: E402
    get_rht_matrix,
)
from torchao.prototype.mx_formats.config import (  # noqa: E402
    MXFP8Dim0CastKernelChoice,
    MXFP8Dim1CastKernelChoice,
    ScaleCalculationMode,
)
from torchao.prototype.mx_formats.kernels import unpack_uint4  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor as AONVFP4  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize as ao_nvfp4  # noqa: E402
from torchao.quantization.quantize_.common.kernel_preference import (  # noqa: E402
    KernelPreference,
)

RULES = {"rceil": ScaleCalculationMode.RCEIL, "floor": ScaleCalculationMode.FLOOR}


def inputs() -> dict[str, torch.Tensor]:
    """The kinds of tensor the formats must agree on, 32 x 128 each."""
    g = torch.Generator().manual_seed(0)
    spread = torch.exp2(torch.randint(-30, 30, (32, 1), generator=g).float())
    nonfinite = torch.randn(32, 128, generator=g)
    nonfinite[0, 3], nonfinite[1, 40], nonfinite[2, 5] = float("inf"), float("nan"), -float("inf")
    nonfinite[3, :32] = float("inf")
    mixed = torch.randn(32, 128, generator=g)
    mixed[:, 64:] = 0.0
    return {"random": torch.randn(32, 128, generator=g) * spread,
            "zero": torch.zeros(32, 128), "zero blocks": mixed,
            "subnormal": torch.randn(32, 128, generator=g) * 1e-40,
            "huge": torch.randn(32, 128, generator=g) * 1e37,
            "nonfinite": nonfinite,
            "bf16": (torch.randn(32, 128, generator=g) * spread).bfloat16()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs included)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(width), b.view(width))


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_mxfp8_quantisation_equals_torchao(fmt, rule):
    for name, x in inputs().items():
        scale, data = mx_tensor.to_mx(x.contiguous(), fmt.dtype, 32, RULES[rule])
        mine, e = mx_quantize(x, fmt, 32, rule)
        assert same_bits(e, scale.view(torch.uint8)), f"{name}: E8M0 scales differ"
        assert same_bits(mine, data), f"{name}: elements differ"
        ref = mx_tensor.to_dtype(data, scale, fmt.dtype, 32, torch.float32)
        assert same_bits(mx_dequantize(mine, e), ref), f"{name}: dequantised values differ"


def test_nvfp4_quantisation_equals_torchao():
    """torchao's two-level NVFP4 with the per-tensor scale from the amax; for an all-zero
    tensor (torchao's ``per_tensor_amax_to_scale`` gives 0 there, then NaN) both get the
    scale 1 this module uses."""
    for name, x in inputs().items():
        ts = per_tensor_scale(x.float().abs().amax())
        scale, packed = ao_nvfp4(x.contiguous(), 16, ts)
        mine = nvfp4_quantize(x, ts)
        assert torch.equal(mine.codes, unpack_uint4(packed)), f"{name}: E2M1 codes differ"
        assert same_bits(mine.block_scale, scale), f"{name}: E4M3 block scales differ"
        ref = AONVFP4(packed, scale, 16, x.dtype, ts).dequantize(torch.float32)
        assert same_bits(mine.dequantize(), ref), f"{name}: dequantised values differ"


def test_nvfp4_weight_blocks_of_16x16_equal_torchao_where_rows_share_the_block_amax():
    """The 16 x 16 scales of a weight equal torchao's 1 x 16 ones when every row of a block
    holds the block's amax (placed at a random column, with a random sign)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g)
    blocks = w.abs().reshape(4, 16, 6, 16).amax(dim=(1, 3))
    for r in range(64):
        for c in range(6):
            col = c * 16 + int(torch.randint(16, (1,), generator=g))
            w[r, col] = blocks[r // 16, c] * (1 if torch.rand(1, generator=g) < 0.5 else -1)
    ts = per_tensor_scale(w.abs().amax())
    scale, packed = ao_nvfp4(w, 16, ts)
    mine = nvfp4_quantize(w, ts, (16, 16))
    assert mine.block_scale.shape == (4, 6)
    assert torch.equal(mine.codes, unpack_uint4(packed))
    assert same_bits(mine.block_scale.repeat_interleave(16, 0), scale)
    assert torch.equal(mine.dequantize(), nvfp4_quantize(w, ts).dequantize())


def test_e2m1_rounds_to_nearest_even_and_saturates():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, float("inf"), -0.0, -0.2, 0.26])
    assert e2m1_values(e2m1_codes(v)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0,
                                                   -0.0, -0.0, 0.5]


def test_hadamard_transform_is_torchaos_and_keeps_the_weight_gradient():
    signs = hadamard_signs(7)
    m = hadamard16(signs)
    assert torch.equal(m, get_rht_matrix(tuple(int(s) for s in signs), "cpu", torch.float32, 16))
    assert torch.allclose(m @ m.t(), torch.eye(16), atol=1e-6)
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(40, 24, generator=g), torch.randn(40, 8, generator=g)  # 40: padded
    product = rht_along_rows(dy, signs) @ rht_along_rows(x, signs).t()
    assert torch.allclose(product, dy.t() @ x, atol=1e-5)


def test_mxfp8_linear_equals_torchaos_emulated_mx_mm():
    """Output, input gradient and weight gradient of a layer (E4M3 gradients, rceil) equal to
    torchao's ``mx_mm``, which quantises each product's operands along its reduction."""
    g = torch.Generator().manual_seed(3)

    def spread(rows: int, cols: int) -> torch.Tensor:  # rows and columns of unlike magnitudes
        return torch.randn(rows, cols, generator=g) * torch.exp2(
            torch.randint(-6, 6, (rows, 1), generator=g) + torch.randint(-6, 6, (1, cols),
                                                                         generator=g))

    x0, w0, gy = spread(64, 96), spread(32, 96), spread(64, 32)
    ref_x, ref_w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = mx_mm.apply(ref_x, ref_w, E4M3.dtype, E4M3.dtype, E4M3.dtype, 32,
                      KernelPreference.EMULATED, MXFP8Dim0CastKernelChoice.TORCH,
                      MXFP8Dim1CastKernelChoice.TORCH, ScaleCalculationMode.RCEIL, False)
    ref.backward(gy)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = fp8_linear(x, w, None, MXScaling("rceil"), "e4m3")
    y.backward(gy)
    for name, a, b in (("y", y, ref), ("grad x", x.grad, ref_x.grad),
                       ("grad w", w.grad, ref_w.grad)):
        assert torch.equal(a, b), name


def test_stochastic_rounding_is_deterministic_and_independent_of_the_split():
    """The same seed rounds alike; the two column halves a tp=2 column-parallel layer holds
    (amax agreed over the pair) round exactly as the whole tensor's columns do."""
    g = torch.Generator().manual_seed(4)
    dy = torch.randn(48, 64, generator=g)
    whole = NVFP4Options(seed=11)
    a, b = whole.quantize(dy, "grad", salt=1), whole.quantize(dy, "grad", salt=1)
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, NVFP4Options(seed=12).quantize(dy, "grad", salt=1).codes)
    amax = dy.abs().amax()
    split = NVFP4Options(seed=11, reduce_amax=lambda local: torch.maximum(local, amax))
    halves = [split.quantize(part, "grad", salt=1, features=torch.arange(32) + 32 * i)
              for i, part in enumerate(dy.split(32, dim=1))]
    assert torch.equal(torch.cat([h.codes for h in halves], 1), a.codes)
    assert torch.equal(torch.cat([h.dequantize() for h in halves], 1), a.dequantize())


def test_stochastic_rounding_is_unbiased():
    """Values between E2M1 grid points, each rounded at 4096 token positions: the mean of the
    rounded values is within 5 standard errors of the value (fixed seed: the outcome is fixed),
    where rounding to nearest is off by up to half a grid step."""
    values = torch.tensor([0.1, 0.3, 0.6, 1.1, 1.4, 1.8, 2.2, 2.9, 3.3, 4.5, 5.2, -2.7])
    rows = torch.arange(4096).unsqueeze(1)
    v = values.expand(4096, -1).contiguous()
    opts = NVFP4Options(seed=5)
    from meshtron.precision.nvfp4 import hashed_uniform

    uniform = hashed_uniform(v, rows, torch.arange(len(values)), opts.seed)
    rounded = e2m1_values(e2m1_codes(v, uniform))
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    step = grid[torch.searchsorted(grid, values.abs())] - grid[
        torch.searchsorted(grid, values.abs()) - 1]
    stderr = step / 2 / 64
    assert ((rounded.mean(0) - values).abs() <= 5 * stderr).all(), rounded.mean(0) - values
    nearest = e2m1_values(e2m1_codes(values))
    assert ((nearest - values).abs() > 5 * stderr).sum() >= 10


def test_nvfp4_linear_is_close_to_the_exact_product_and_unbiased_in_its_gradients():
    g = torch.Generator().manual_seed(6)
    x0, w0 = torch.randn(64, 48, generator=g), torch.randn(32, 48, generator=g)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = nvfp4_linear(x, w, None, NVFP4Options(seed=1))
    y.backward(torch.ones_like(y))
    exact = x0 @ w0.t()
    assert (y - exact).norm() / exact.norm() < 0.15
    assert (w.grad - torch.ones(64, 32).t() @ x0).norm() / (64 * 48) ** 0.5 < 1.0


def test_an_fp64_nvfp4_layer_quantises_in_fp32_and_multiplies_in_fp64():
    """The fp64 verification run's layer: the same codes and scales as fp32's (quantising
    the operands rounded to fp32), products of the dequantised operands in fp64; the output
    and the input gradient come out exactly as those fp64 products."""
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(32, 48, generator=g, dtype=torch.float64)
    w0 = torch.randn(32, 48, generator=g, dtype=torch.float64)
    opts = NVFP4Options(seed=3)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = nvfp4_linear(x, w, None, opts)
    gy = torch.randn(32, 32, generator=g, dtype=torch.float64)
    y.backward(gy)
    qx = opts.quantize(x0.float(), "input").dequantize().double()
    qw = opts.quantize(w0.float(), "weight", (16, 16)).dequantize().double()
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.float64
    assert torch.equal(y, qx @ qw.t())
    qgy = opts.quantize(gy.float(), "output gradient", salt=1,
                        features=torch.arange(32)).dequantize().double()
    assert torch.equal(x.grad, qgy @ qw)
    assert not torch.equal(y, (qx.float() @ qw.float().t()).double())  # fp32 sums differ


@pytest.mark.parametrize("call, message", [
    (lambda: mx_quantize(torch.zeros(4, 48)), "divisible by the block of 32 elements, got 48"),
    (lambda: fp8_linear(torch.zeros(4, 48), torch.zeros(32, 48), None, MXScaling()),
     "precision.fp8=mxfp8 needs in_features divisible by the MX block of 32, got 48"),
    (lambda: fp8_linear(torch.zeros(4, 32), torch.zeros(48, 32, requires_grad=True), None,
                        MXScaling()).sum().backward(),
     "needs out_features divisible by the MX block of 32, got 48"),
    (lambda: nvfp4_quantize(torch.zeros(4, 24), torch.tensor(1.0)),
     r"\[4, 24\] tensor to be whole 1 x 16 blocks"),
    (lambda: nvfp4_linear(torch.zeros(4, 32), torch.zeros(24, 32), None, NVFP4Options()),
     r"\[24, 32\] tensor to be whole 16 x 16 blocks"),
    (lambda: fp8_linear(torch.full((4, 32), float("inf")), torch.zeros(32, 32), None,
                        MXScaling()), "non-finite amax"),
    (lambda: nvfp4_linear(torch.full((4, 32), float("nan")), torch.zeros(32, 32), None,
                          NVFP4Options()), "non-finite amax"),
])
def test_bad_shapes_and_non_finite_amaxes_are_one_line(call, message):
    with pytest.raises(MeshtronError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_mxfp8_expert_products_equal_one_mxfp8_layer_per_expert(grouped):
    """The MoE experts' grouped product in MXFP8 gives what each expert's rows through its own
    MXFP8 layer give: output, input gradient and every expert's weight gradient (the token
    blocks of the weight gradient run inside each expert's rows; one expert gets none)."""
    from functools import partial

    from meshtron.parallel.experts.grouped import grouped_matmul
    from meshtron.precision.mx import MXExperts

    g = torch.Generator().manual_seed(8)
    counts = torch.tensor([40, 0, 17, 7])
    x0 = torch.randn(64, 64, generator=g) * torch.exp2(torch.randint(-5, 5, (64, 1), generator=g))
    w0 = torch.randn(4, 32, 64, generator=g)
    gy = torch.randn(64, 32, generator=g)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = MXExperts().matmul(x, w, counts, partial(grouped_matmul, grouped=grouped))
    y.backward(gy)
    for e, (rows, dy) in enumerate(zip(x0.split(counts.tolist()), gy.split(counts.tolist()))):
        xe, we = rows.clone().requires_grad_(), w0[e].clone().requires_grad_()
        ye = fp8_linear(xe, we, None, MXScaling(), "e5m2")
        ye.backward(dy)
        start = int(counts[:e].sum())
        assert torch.equal(y[start:start + len(rows)], ye), e
        assert torch.equal(x.grad[start:start + len(rows)], xe.grad), e
        assert torch.equal(w.grad[e], we.grad), e


def test_mxfp8_expert_rows_from_several_ep_ranks_quantise_as_each_ranks_alone():
    """Under expert parallelism an expert's rows are a micro-batch's rows from each ep rank,
    one after the other (``sources``): the weight gradient's token blocks restart at each
    rank's rows, so the expert's weight gradient is the sum of what each rank's rows give
    alone (one process's micro-batches), and outputs and input gradients are theirs. A block
    scale is a power of two, so another blocking changes an element only where it falls below
    E4M3's normal range, 2^14 under its block's amax: the ranks' rows here are 2^18 apart (their
    output gradients 2^-18, so both ranks' shares of the weight gradient count)."""
    from functools import partial

    from meshtron.parallel.experts.grouped import grouped_matmul
    from meshtron.precision.mx import MXExperts

    g = torch.Generator().manual_seed(9)
    sources = torch.tensor([[20, 13], [0, 9], [25, 0], [7, 40]])
    counts = sources.sum(1)
    rows = int(counts.sum())
    apart = torch.cat([torch.tensor([2.0**9] * a + [2.0**-9] * b)
                       for a, b in sources.tolist()])
    x0 = torch.randn(rows, 64, generator=g) * apart[:, None]
    w0 = torch.randn(4, 32, 64, generator=g)
    gy = torch.randn(rows, 32, generator=g) / apart[:, None]  # each rank's share alike
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y = MXExperts().matmul(x, w, counts, partial(grouped_matmul, grouped=True), sources)
    y.backward(gy)
    start = 0
    for e, sizes in enumerate(sources.tolist()):
        grad_w = torch.zeros_like(w0[e])
        for size in sizes:
            xs, we = x0[start:start + size].clone().requires_grad_(), w0[e].clone()
            ys = fp8_linear(xs, we.requires_grad_(), None, MXScaling(), "e5m2")
            ys.backward(gy[start:start + size])
            assert torch.equal(y[start:start + size], ys), e
            assert torch.equal(x.grad[start:start + size], xs.grad), e
            grad_w += we.grad
            start += size
        torch.testing.assert_close(w.grad[e], grad_w, rtol=1e-5,
                                   atol=1e-5 * float(grad_w.abs().max()))
