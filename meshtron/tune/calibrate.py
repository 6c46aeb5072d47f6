"""``meshtron tune --calibrate``: measure the machine at hand for its cluster profile (the
command around it, and the probe training runs that end it: ``calibrate_command.py``).

The cost model's figures, measured the way training uses the machine: GEMMs of transformer
shapes and the attention core on one thread (the trainer's ranks run one thread each when they
share the cores), a large copy, the memory a trainer process holds before its model, and every
collective over the default process group (gloo on CPU, NCCL on CUDA) with all ranks busy, the
world split into concurrent groups as tp groups are in training.

With ``--nproc N`` the command starts N ranks of itself (under torchrun each rank is started
already). Rank 0 measures the compute figures alone while the others wait at a barrier, so no
rank competes for its cores; every rank then takes part in the collectives, and rank 0 writes
the profile. One rank measures no link: its profile's link is the memory copy's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtron.costmodel.gemm_shape import shape_factor
from meshtron.costmodel.profiles import AMPERE_TILE, COLLECTIVES, HOPPER_TILE, ClusterProfile, Link
from meshtron.training.hardware import cpu_name
from meshtron.training.memory import device_memory_bytes

CPU_GPUS_PER_NODE = 8
"""A CPU profile's "GPUs per node": how many ranks the tuner may place on this one machine
(they share its ``compute_units`` cores)."""
CURVE_STEPS_PER_DECADE = 4
"""The efficiency curve's grid: one point per quarter decade of GEMM FLOPs."""
ELEMENT_BYTES = 4
"""Collectives move fp32 buffers: their cost is per byte, whatever the dtype."""
RANK_TIMEOUT_S = 600.0
"""How long a rank waits at a barrier while rank 0 measures the compute figures alone."""


@dataclass(frozen=True)
class Settings:
    """What one calibration measures; ``--quick`` takes fewer shapes, sizes and repeats."""

    gemm_shapes: tuple[tuple[int, int, int], ...]
    """(m tokens, n outputs, k inputs) of each GEMM."""
    attention_shapes: tuple[tuple[int, int, int, int], ...]
    """(batch, heads, sequence, head dim) of each attention core."""
    thread_shape: tuple[int, int, int]
    copy_bytes: int
    message_bytes: tuple[int, ...]
    repeats: int
    collective_repeats: int
    """More than the compute's: on shared cores a small collective takes either ~0.4 ms or
    ~4 ms, as the ranks' threads happen to be scheduled, and the median needs enough of both."""
    min_sample_s: float
    """Each timed sample repeats a call until it lasts this long (a 64^3 GEMM takes ~10 us)."""


def settings(quick: bool, cuda: bool) -> Settings:
    """The full calibration takes a minute or two on 2 cores; the quick one a few seconds."""
    if cuda:  # larger shapes: a GPU reaches its peak only on large GEMMs
        tokens = (1024, 8192) if quick else (256, 1024, 4096, 8192)
        widths = ((1024, 1024), (4096, 4096)) if quick else (
            (256, 256), (1024, 1024), (4096, 1024), (1024, 4096), (4096, 4096), (8192, 8192))
        attention = ((2, 4, 256, 16), (4, 32, 4096, 128))
        thread, copy = (4096, 4096, 4096), 2**30
    elif quick:
        tokens, widths = (64, 512), ((64, 64), (256, 256), (1024, 1024))
        attention = ((2, 4, 256, 16), (2, 8, 256, 32))
        thread, copy = (512, 1024, 1024), 32 * 2**20
    else:
        tokens = (64, 256, 1024, 4096)
        widths = ((64, 64), (256, 256), (1024, 1024), (2048, 512), (512, 2048), (2048, 2048))
        attention = ((2, 4, 256, 16), (2, 12, 1024, 64))
        thread, copy = (2048, 1024, 1024), 256 * 2**20
    messages = (2**12, 2**17, 2**23) if quick else tuple(2**i for i in range(12, 24, 2)) + (
        2**23,)
    return Settings(
        gemm_shapes=tuple((m, n, k) for m in tokens for n, k in widths),
        attention_shapes=attention, thread_shape=thread, copy_bytes=copy,
        message_bytes=messages, repeats=3 if quick else 5,
        collective_repeats=7 if quick else 11,
        min_sample_s=0.002 if quick else 0.01)


def gemm_dtypes(device: torch.device) -> tuple[tuple[str, torch.dtype], ...]:
    """The dtypes measured, first the one training uses there: its GEMMs give the profile's
    one efficiency curve, and its peak is what the attention core is measured against."""
    if device.type == "cuda":
        return ("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)
    return ("fp32", torch.float32), ("bf16", torch.bfloat16)


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What makes the host wait for the device's queued work (nothing on a CPU)."""
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return lambda: None


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run with ``count`` torch threads, restoring the caller's count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def median_time(fn: Callable[[], object], s: Settings, device: torch.device) -> float:
    """Median seconds per call after a warm-up. A sample loops the call until it lasts
    ``min_sample_s``, so a microsecond GEMM is not timed at the clock's resolution."""
    sync = synchronizer(device)
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    calls = max(1, math.ceil(s.min_sample_s / max(time.perf_counter() - start, 1e-9)))
    samples = []
    for _ in range(s.repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def gemm_rates(shapes: tuple[tuple[int, int, int], ...], dtype: torch.dtype,
               device: torch.device, s: Settings) -> list[tuple[float, float]]:
    """(FLOPs, FLOP/s) of each (m, n, k) GEMM: 2mnk FLOPs, an (m, k) by (k, n) product."""
    generator = torch.Generator(device=device).manual_seed(0)
    rates = []
    for m, n, k in shapes:
        a = torch.randn(m, k, generator=generator, device=device).to(dtype)
        b = torch.randn(k, n, generator=generator, device=device).to(dtype)
        flops = 2.0 * m * n * k
        seconds = median_time(functools.partial(torch.mm, a, b), s, device)
        rates.append((flops, flops / seconds))
    return rates


def efficiency_curve(rates: list[tuple[float, float]], peak: float,
                     shape_factors: list[float] | None = None) -> tuple[tuple[float, float], ...]:
    """(GEMM FLOPs, fraction of ``peak``) on a log grid, strictly rising in FLOPs as profiles
    require: the median fraction of the shapes in each quarter decade (training runs all of
    them, not the fastest; the best alone priced every GEMM above 3e7 FLOPs at the peak, about
    15% fast), then the running maximum (a larger GEMM is not less efficient; a dip is noise).
    ``shape_factors`` (a GPU's, per rate): what each shape's quantization and epilogue give
    against a square GEMM's (:mod:`meshtron.costmodel.gemm_shape`), divided out so the curve
    is the square GEMMs' the cost model scales by shape again."""
    fractions: dict[int, list[float]] = {}
    for i, (flops, rate) in enumerate(rates):
        step = round(math.log10(flops) * CURVE_STEPS_PER_DECADE)
        factor = shape_factors[i] if shape_factors else 1.0
        fractions.setdefault(step, []).append(rate / peak / factor)
    curve, running = [], 0.0
    for step in sorted(fractions):
        running = max(running, statistics.median(fractions[step]))
        flops = float(f"{10 ** (step / CURVE_STEPS_PER_DECADE):.4g}")
        curve.append((flops, min(1.0, max(round(running, 4), 1e-4))))
    return tuple(curve)


def thread_speedup(s: Settings) -> float:
    """A large fp32 GEMM's rate on every core over its rate on one: what a single process
    gains from the cores that N ranks would take one each. At least 1 (less is other load)."""
    cpu = torch.device("cpu")
    one = gemm_rates((s.thread_shape,), torch.float32, cpu, s)[0][1]
    with torch_threads(os.cpu_count() or 1):
        many = gemm_rates((s.thread_shape,), torch.float32, cpu, s)[0][1]
    return max(1.0, round(many / one, 3))


def attention_fraction(shape: tuple[int, int, int, int], dtype: torch.dtype,
                       device: torch.device, peak: float, s: Settings) -> float:
    """Fraction of ``peak`` that causal scaled-dot-product attention achieves forward and
    backward, counting 2·b·h·s²·d FLOPs forward (4·b·h·s²·d halved by the causal mask) and
    2.5 times that backward, as the cost model counts the attention core."""
    b, h, seq, d = shape
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad = (torch.randn(b, h, seq, d, generator=generator, device=device).to(dtype)
                     for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    seconds = median_time(step, s, device)
    return 3.5 * 2.0 * b * h * seq * seq * d / seconds / peak


def copy_bandwidth(nbytes: int, device: torch.device, s: Settings) -> float:
    """Bytes read plus written per second by a large copy: what the optimizer step (a few
    passes over the parameters and their state) is bound by."""
    src = torch.ones(nbytes // ELEMENT_BYTES, device=device)  # filled: every page is touched
    dst = torch.zeros_like(src)
    return 2.0 * src.nbytes / median_time(functools.partial(dst.copy_, src), s, device)


def reserved_bytes(device: torch.device) -> int:
    """Memory a trainer process holds besides its model. On CPU the trainer's peak measure
    (``ru_maxrss``) also counts the interpreter, torch and meshtron: this process's resident
    peak once the trainer is imported and a tiny matmul has run, read before any calibration
    buffer exists (from a fresh command process, as ``meshtron train`` would be). On CUDA: the
    context and whatever else holds the GPU, the memory in use that torch's allocator did not
    reserve."""
    from meshtron.training import trainer  # what a training process has imported: measured

    x = torch.ones(8, 8, device=device)
    torch.mm(x, x)
    if device.type != "cuda":
        return trainer.peak_memory_bytes(device)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def machine_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def source(device: torch.device, ranks: int) -> str:
    return (f"calibrated on {machine_name(device)}, {ranks} rank{'s' if ranks > 1 else ''}, "
            f"torch {torch.__version__}, {datetime.date.today().isoformat()}")


def measure_process(quick: bool, device: torch.device) -> ClusterProfile:
    """The profile of one rank on this machine: compute, attention and memory, on one thread.
    Its link is the memory copy's (one rank measures none: see :func:`with_collectives`)."""
    s = settings(quick, device.type == "cuda")
    reserved = reserved_bytes(device)  # first: before any large buffer raises the peak
    with torch_threads(1):
        rates = {name: gemm_rates(s.gemm_shapes, dtype, device, s)
                 for name, dtype in gemm_dtypes(device)}
        peaks = {name: max(rate for _, rate in points) for name, points in rates.items()}
        main, dtype = gemm_dtypes(device)[0]
        attention = [attention_fraction(shape, dtype, device, peaks[main], s)
                     for shape in s.attention_shapes]
        bandwidth = copy_bandwidth(s.copy_bytes, device, s)
    cpu = device.type != "cuda"
    sms, tile = (None, HOPPER_TILE) if cpu else gpu_tiling(device)
    factors = None if sms is None else [
        shape_factor(m, n, k, sms, tile, peaks[main], bandwidth) for m, n, k in s.gemm_shapes]
    return ClusterProfile(
        name="calibrated", source=source(device, 1),
        gpus_per_node=CPU_GPUS_PER_NODE if cpu else torch.cuda.device_count(),
        memory_bytes=device_memory_bytes(device), memory_bandwidth=bandwidth,
        peak_flops=peaks, intra_node=Link(bandwidth, 0.0), inter_node=Link(bandwidth, 0.0),
        gemm_efficiency=efficiency_curve(rates[main], peaks[main], factors),
        attention_efficiency=min(1.0, round(statistics.mean(attention), 4)),  # one for all
        memory_reserved_bytes=reserved, step_overhead_s=0.0,
        compute_units=os.cpu_count() if cpu else None,
        thread_speedup=thread_speedup(s) if cpu else 1.0, sm_count=sms, gemm_tile=tile)


def gpu_tiling(device: torch.device) -> tuple[int, tuple[int, int, int]]:
    """The GPU's SM count and the GEMM tile of its generation: Ampere's before Hopper."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, AMPERE_TILE if props.major < 9 else HOPPER_TILE


def group_sizes(world: int) -> list[int]:
    """Powers of two up to the world size, and the world size itself."""
    sizes = [2**i for i in range(1, world.bit_length()) if 2**i <= world]
    return sizes + [world] if world > 1 and world not in sizes else sizes


def consecutive_group(n: int, world: int, rank: int) -> dist.ProcessGroup | None:
    """This rank's group of ``n`` consecutive ranks (None for a rank left over when ``n`` does
    not divide the world). Every rank creates every group in the same order, as
    ``new_group`` requires."""
    if n == world:
        return dist.group.WORLD
    mine = None
    for first in range(0, world - n + 1, n):
        group = dist.new_group(list(range(first, first + n)))
        if first <= rank < first + n:
            mine = group
    return mine


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collective_op(kind: str, nbytes: int, n: int, group: dist.ProcessGroup | None, rank: int,
                  device: torch.device) -> tuple[Callable[[], object], int]:
    """One call of ``kind`` on this rank's group, and the bytes of the rank's full buffer it
    is fitted by: the tensor (all_reduce), the gathered output (all_gather), the input
    (reduce_scatter, all_to_all), the message (send_recv, between ranks 2i and 2i+1). A rank
    outside every group gets a call that does nothing."""
    chunk = max(1, nbytes // ELEMENT_BYTES // n)
    full = torch.zeros(chunk * n, device=device)
    if group is None:
        return lambda: None, full.nbytes
    if kind == "all_reduce":
        return functools.partial(dist.all_reduce, full, group=group), full.nbytes
    if kind == "all_gather":
        part = torch.zeros(chunk, device=device)
        return functools.partial(_all_gather, full, part, group=group), full.nbytes
    if kind == "reduce_scatter":
        part = torch.zeros(chunk, device=device)
        return functools.partial(_reduce_scatter, part, full, group=group), full.nbytes
    received = torch.empty_like(full)
    if kind == "all_to_all":
        return (functools.partial(dist.all_to_all_single, received, full, group=group),
                full.nbytes)

    def exchange() -> None:
        # one batch: NCCL runs a lone send and receive of one pair in order on one stream,
        # and each rank's send would wait for a receive queued behind the other's send
        peer = rank ^ 1
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, full, peer),
                                            dist.P2POp(dist.irecv, received, peer)]):
            work.wait()

    return exchange, full.nbytes


def time_collective(op: Callable[[], object], s: Settings, device: torch.device) -> float:
    """Median over repeats of the slowest rank's time. Each repeat starts at a barrier of the
    whole world, so every group runs at once, as concurrent tp groups do in training."""
    sync = synchronizer(device)
    op()
    sync()
    samples = []
    for _ in range(s.collective_repeats):
        dist.barrier()
        start = time.perf_counter()
        op()
        sync()
        samples.append(time.perf_counter() - start)
    slowest = torch.tensor(samples, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of t = a + b·bytes by least squares in relative error (weights 1/t²): the sizes
    span three decades, and an unweighted fit lets the largest decide alone, often with a
    negative a. Both are clipped to >= 0 (each refitted alone when the other is)."""
    w = [1.0 / t**2 for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sy = sum(wi * t for wi, (_, t) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sxy = sum(wi * x * t for wi, (x, t) in zip(w, points))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det if det > 0 else 0.0
    a = (sy - b * sx) / sw
    if b <= 0:
        return max(0.0, sy / sw), 0.0
    if a < 0:
        return 0.0, sxy / sxx
    return a, b


def measure_collectives(quick: bool, world: int, rank: int,
                        device: torch.device) -> dict[str, dict[int, tuple[float, float]]]:
    """Fits per collective and group size over the default process group, called by every
    rank alike. send_recv is measured between pairs only (group size 2)."""
    s = settings(quick, device.type == "cuda")
    fits: dict[str, dict[int, tuple[float, float]]] = {}
    for n in group_sizes(world):
        group = consecutive_group(n, world, rank)
        for kind in COLLECTIVES:
            if kind == "send_recv" and n != 2:
                continue
            points = []
            for nbytes in s.message_bytes:
                op, size = collective_op(kind, nbytes, n, group, rank, device)
                points.append((size, time_collective(op, s, device)))
            fits.setdefault(kind, {})[n] = fit_line(points)
    return fits


def ring_link(fit: tuple[float, float], n: int) -> Link | None:
    """The link a ring all-reduce over ``n`` ranks implies: 2(n-1) steps of latency, and
    2(n-1)/n of the buffer moved one way by each rank (None without a slope)."""
    a, b = fit
    steps = 2 * (n - 1)
    return Link(bandwidth=steps / n / b, latency=a / steps) if b > 0 else None


def with_collectives(profile: ClusterProfile, fits: dict[str, dict[int, tuple[float, float]]],
                     world: int, device: torch.device, copy: float = 0.0) -> ClusterProfile:
    """The process profile with the collectives' fits, the backend's reduce-scatter copy, and
    its link (inside and across nodes: there is one machine) from the all_reduce over the most
    ranks that shows a slope."""
    reduce = fits.get("all_reduce", {})
    links = (ring_link(reduce[n], n) for n in sorted(reduce, reverse=True))
    link = next((link for link in links if link is not None), profile.intra_node)
    return dataclasses.replace(profile, source=source(device, world), collectives=fits,
                               intra_node=link, inter_node=link, reduce_scatter_copy=copy)


def profile_summary(profile: ClusterProfile, output: Path) -> str:
    """A few lines saying what was measured, for the person who ran the command."""
    curve = profile.gemm_efficiency
    peaks = ", ".join(f"{k} {v / 1e9:,.1f}" for k, v in profile.peak_flops.items())
    lines = [
        f"{profile.source}: wrote {output}",
        f"  GEMM peak (one thread, GFLOP/s): {peaks}; efficiency {curve[0][1]:.2f} at "
        f"{curve[0][0]:.1e} FLOPs rising to {curve[-1][1]:.2f} at {curve[-1][0]:.1e}",
        f"  attention core (causal, forward and backward): {profile.attention_efficiency:.2f} "
        "of that peak",
        f"  memory {profile.memory_bytes / 2**30:,.1f} GiB, copy "
        f"{profile.memory_bandwidth / 1e9:,.1f} GB/s, "
        f"{profile.memory_reserved_bytes / 2**20:,.0f} MiB held by the runtime",
    ]
    if profile.sm_count is not None:
        tile = "x".join(str(t) for t in profile.gemm_tile[:2])
        lines.append(f"  GEMM shapes: {profile.sm_count} SMs, {tile} tiles in k steps of "
                     f"{profile.gemm_tile[2]} (the curve is the square GEMMs', shape divided out)")
    if profile.reduce_scatter_copy:
        lines.append(f"  a queued reduce-scatter holds {profile.reduce_scatter_copy:.2f} bytes "
                     "per byte of its input until it completes")
    if profile.compute_units is not None:
        lines.append(f"  {profile.compute_units} cores: a large fp32 GEMM runs "
                     f"{profile.thread_speedup:.2f}x faster on all of them than on one")
    for kind, sizes in profile.collectives.items():
        fits = "; ".join(f"n={n} {a * 1e6:,.0f} us + {_rate(b)}" for n, (a, b) in sizes.items())
        lines.append(f"  {kind}: {fits}")
    if not profile.collectives:
        lines.append("  links: not measured on one rank (the copy's figures stand in); "
                     "calibrate with --nproc 2 or more")
    else:
        link = profile.intra_node
        lines.append(f"  link: {link.bandwidth / 1e9:,.2f} GB/s one way per rank, "
                     f"{link.latency * 1e6:,.1f} us per ring step")
    return "\n".join(lines)


def _rate(seconds_per_byte: float) -> str:
    return f"{1 / seconds_per_byte / 1e9:,.2f} GB/s" if seconds_per_byte > 0 else "no slope"
