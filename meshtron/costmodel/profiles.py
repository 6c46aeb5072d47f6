"""Cluster profiles: what one accelerator and its links can do, as plain files a user can edit.

A profile gives the cost model its hardware: peak FLOP/s by dtype, the fraction of it a GEMM of
a given size achieves, memory and its bandwidth, and an alpha-beta model (latency per message,
bytes per second per GPU one way) for the link inside a node and the one across nodes. The
built-in ones come from the vendors' public data sheets (dense, no sparsity) and say so in
``source``; their efficiency curves are typical cuBLAS figures, not measurements. A profile
written by ``meshtron tune --calibrate`` holds what was measured on the machine at hand,
including per-collective fits that override the link model for the group sizes measured, and
the corrections trial runs folded back into it.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from meshtron.costmodel.gemm_shape import shape_factor
from meshtron.errors import MeshtronError

DTYPES = ("fp32", "bf16", "fp16", "fp8", "fp4", "fp64")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class Link:
    """One link level of the alpha-beta model."""

    bandwidth: float
    """Bytes per second each GPU moves one way."""
    latency: float
    """Seconds per message step (a ring collective over n ranks takes n-1 or 2(n-1) steps)."""


@dataclass(frozen=True)
class ClusterProfile:
    name: str
    source: str
    """Where the figures come from: 'from public specs: ...' or 'calibrated on ...'."""
    gpus_per_node: int
    memory_bytes: int
    """Device memory of one GPU (or the share of host memory one CPU rank may use)."""
    memory_bandwidth: float
    """Bytes per second of device memory: what the optimizer step is bound by."""
    peak_flops: dict[str, float]
    """Dense matrix-multiply peak FLOP/s of one device per dtype."""
    intra_node: Link
    inter_node: Link
    gemm_efficiency: tuple[tuple[float, float], ...] = ((1e8, 0.1), (1e10, 0.5), (1e12, 0.75))
    """(FLOPs of one GEMM, fraction of peak it achieves), rising in FLOPs; interpolated in
    log FLOPs and held flat beyond the ends."""
    attention_efficiency: float = 0.5
    """Fraction of peak the fused attention core achieves."""
    memory_reserved_bytes: int = 0
    """Memory that is never the model's: the runtime, the allocator's slack, a CUDA context."""
    memory_reserved_per_rank_bytes: int = 0
    """What each further rank of a node adds to that, on every rank (gloo's buffers per peer);
    measured by the probe runs of ``--calibrate``."""
    memory_step_slack: float = 0.0
    """What the allocator holds at a step's peak beyond the step's own buffers (activations,
    logits, gathered units, collective copies), per byte of them: glibc's heap keeps freed
    chunks that the next step's differently sized ones do not reuse. Measured by the probes of
    ``--calibrate`` (0 on a GPU, whose peak counts live tensors)."""
    reduce_scatter_copy: float = 0.0
    """Bytes the collective backend holds per byte of a queued reduce-scatter's input until it
    completes (gloo copies the whole input at launch; NCCL works in place). Measured by
    ``--calibrate``."""
    compute_correction: float = 1.0
    """Measured over predicted compute time of a probe training step (``--calibrate``): what
    the kernel measurements miss (elementwise kernels, dispatch, the autograd engine)."""
    step_overhead_s: float = 0.0
    """Fixed time per optimizer step (launches, the loss and grad-norm reductions' latency)."""
    compute_units: int | None = None
    """CPU profiles: cores that the ranks of a node share (None: one device per rank)."""
    thread_speedup: float = 1.0
    """CPU profiles: a single rank's GEMM rate on all ``compute_units`` over one thread's."""
    collectives: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    """Measured fits per collective and group size: (seconds, seconds per byte of the
    rank's buffer); they replace the link model for those sizes inside one node."""
    time_correction: float = 1.0
    """Measured over predicted step time, folded back from trial runs."""
    memory_correction: float = 1.0
    """Measured over predicted peak memory, folded back from trial runs."""
    sm_count: int | None = None
    """Streaming multiprocessors: a GEMM's output tiles run in waves of this many
    (:mod:`meshtron.costmodel.gemm_shape`). None (a CPU): the efficiency reads FLOPs alone."""
    gemm_tile: tuple[int, int, int] = (128, 256, 64)
    """(rows, columns, k step) of the GEMM kernels' output tile and main-loop step."""

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise MeshtronError(f"profile '{self.name}' has no peak for {dtype} (it lists "
                                f"{', '.join(self.peak_flops)})")
        return self.peak_flops[dtype]

    def gemm_fraction(self, flops: float) -> float:
        """Fraction of peak one GEMM of ``flops`` achieves (the efficiency curve)."""
        points = self.gemm_efficiency
        sizes = [math.log(f) for f, _ in points]
        x = math.log(max(flops, 1.0))
        i = bisect.bisect_left(sizes, x)
        if i == 0:
            return points[0][1]
        if i == len(points):
            return points[-1][1]
        t = (x - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
        return points[i - 1][1] + t * (points[i][1] - points[i - 1][1])

    def gemm_shape_fraction(self, m: float, n: float, k: float, dtype: str) -> float:
        """Fraction of ``dtype``'s peak an (m, n, k) GEMM achieves: the curve at its FLOPs,
        scaled on a GPU by its shape's quantization and epilogue over a square GEMM's."""
        fraction = self.gemm_fraction(2.0 * m * n * k)
        if self.sm_count is None:
            return fraction
        return min(1.0, fraction * shape_factor(m, n, k, self.sm_count, self.gemm_tile,
                                                self.peak(dtype), self.memory_bandwidth))


def _spec(name: str, source: str, memory_gb: float, bandwidth_tb: float, bf16_tflops: float,
          fp32_tflops: float, fp8_tflops: float | None, nvlink_gb: float, network_gb: float,
          efficiency: tuple[tuple[float, float], ...], fp4_tflops: float | None = None,
          gpus_per_node: int = 8, sm_count: int | None = None,
          gemm_tile: tuple[int, int, int] = ClusterProfile.gemm_tile) -> ClusterProfile:
    peaks = {"fp32": fp32_tflops * 1e12, "bf16": bf16_tflops * 1e12, "fp16": bf16_tflops * 1e12}
    if fp8_tflops:
        peaks["fp8"] = fp8_tflops * 1e12
    if fp4_tflops:
        peaks["fp4"] = fp4_tflops * 1e12
    return ClusterProfile(
        name=name, source=f"from public specs: {source}", gpus_per_node=gpus_per_node,
        memory_bytes=int(memory_gb * 1e9), memory_bandwidth=bandwidth_tb * 1e12,
        peak_flops=peaks,
        intra_node=Link(bandwidth=nvlink_gb * 1e9, latency=5e-6),
        inter_node=Link(bandwidth=network_gb * 1e9, latency=15e-6),
        gemm_efficiency=efficiency, attention_efficiency=0.45,
        memory_reserved_bytes=int(3e9), step_overhead_s=0.01, sm_count=sm_count,
        gemm_tile=gemm_tile)


AMPERE_GEMMS = ((1e8, 0.1), (1e9, 0.35), (1e10, 0.6), (1e11, 0.72), (1e12, 0.78))
HOPPER_GEMMS = ((1e8, 0.05), (1e9, 0.2), (1e10, 0.45), (1e11, 0.62), (1e12, 0.7))
BLACKWELL_GEMMS = ((1e8, 0.03), (1e9, 0.12), (1e10, 0.35), (1e11, 0.55), (1e12, 0.65))
A100_SMS = 108
"""NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs on the A100 (SXM4 and PCIe);
the "Matrix Multiplication Background User's Guide" works its wave examples on these 108."""
AMPERE_TILE = (256, 128, 64)
"""cuBLAS's large bf16 kernels on A100 (``ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_stages_
64x3_tn`` in public profiler traces: a 256x128 tile, k steps of 64 in 3 stages); the guide's
own example tile is 256x128."""
H100_SXM_SMS = 132
"""NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132 SMs on the H100 SXM5 (the H200 is
the same GH100 die in the SXM form)."""
HOPPER_TILE = (128, 256, 64)
"""cuBLAS's large 16-bit kernels on H100 (``sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize
128x256x64_warpgroupsize2x1x1_...``, as public profiler traces name them): a 128x256 output
tile, k steps of 64."""


def builtin_profiles() -> dict[str, ClusterProfile]:
    """The spec-derived profiles, by the names ``--cluster.gpu`` takes. Link bandwidths are one
    way per GPU: NVLink's total over two, and one NIC per GPU (HDR 200 Gb/s on DGX A100, NDR
    400 Gb/s on DGX H100/H200/B200)."""
    return {p.name: p for p in (
        _spec("a100-40gb", "NVIDIA A100 SXM4 40GB data sheet; DGX A100", 40, 1.555, 312,
              19.5, None, 300, 25, AMPERE_GEMMS, sm_count=A100_SMS, gemm_tile=AMPERE_TILE),
        _spec("a100-80gb", "NVIDIA A100 SXM4 80GB data sheet; DGX A100", 80, 2.039, 312,
              19.5, None, 300, 25, AMPERE_GEMMS, sm_count=A100_SMS, gemm_tile=AMPERE_TILE),
        _spec("h100-sxm", "NVIDIA H100 SXM5 data sheet; DGX H100", 80, 3.35, 989, 67, 1979,
              450, 50, HOPPER_GEMMS, sm_count=H100_SXM_SMS, gemm_tile=HOPPER_TILE),
        _spec("h200", "NVIDIA H200 SXM data sheet; DGX H200", 141, 4.8, 989, 67, 1979, 450, 50,
              HOPPER_GEMMS, sm_count=H100_SXM_SMS, gemm_tile=HOPPER_TILE),
        # Meta's Grand Teton H100: an SXM H100 with 96 GB of HBM2e at 2.4 TB/s, run at a 500 W
        # limit, 400 Gb/s RDMA per GPU (TorchTitan's benchmark pages); no data sheet gives
        # the peak at 500 W (TorchTitan: "between SXM and NVL ... we don't know its exact
        # value"), so the die's SXM figures stand as the upper bound
        _spec("h100-hbm2e", "TorchTitan benchmarks/llama3_h100_202412_torchtitan.md "
              "(Grand Teton H100, 96 GB HBM2e, 2.4 TB/s, 500 W); peaks: the H100 SXM5 data "
              "sheet's, an upper bound", 96, 2.4, 989, 67, 1979, 450, 50, HOPPER_GEMMS,
              sm_count=H100_SXM_SMS, gemm_tile=HOPPER_TILE),
        _spec("b200", "NVIDIA HGX B200 data sheet; DGX B200", 180, 8.0, 2250, 75, 4500, 900, 50,
              BLACKWELL_GEMMS, fp4_tflops=9000),
        # one NVLink domain of 72 GPUs (the node of the alpha-beta model); per GPU: the NVL72
        # rack's dense figures / 72 (FP4 10 PF, FP8 5 PF, BF16 2.5 PF, FP32 80 TF), 186 GB
        # HBM3e at 8 TB/s, NVLink 5 1.8 TB/s both ways, one 400 Gb/s NIC
        _spec("gb200", "NVIDIA GB200 NVL72 data sheet (per GPU)", 186, 8.0, 2500, 80, 5000,
              900, 50, BLACKWELL_GEMMS, fp4_tflops=10000, gpus_per_node=72),
    )}


def load_profile(name_or_path: str) -> ClusterProfile:
    """A built-in profile by name, or a profile file (JSON) by its path."""
    builtins = builtin_profiles()
    if name_or_path in builtins:
        return builtins[name_or_path]
    path = Path(name_or_path)
    if not path.suffix == ".json" and not path.exists():
        raise MeshtronError(f"unknown GPU '{name_or_path}': use one of "
                            f"{', '.join(builtins)} or the path of a profile .json")
    try:
        raw = json.loads(path.read_text())
    except OSError as err:
        raise MeshtronError(f"cannot read profile {path}: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MeshtronError(f"profile {path} is not valid JSON: {err}") from None
    return profile_from_dict(raw, str(path))


def _number(raw: dict, key: str, where: str, *, positive: bool = True) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MeshtronError(f"profile {where}: '{key}' must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise MeshtronError(f"profile {where}: '{key}' must be "
                            f"{'positive' if positive else 'non-negative'}, got {value}")
    return float(value)


def _link(raw: object, key: str, where: str) -> Link:
    if not isinstance(raw, dict):
        raise MeshtronError(f"profile {where}: '{key}' must be an object with bandwidth and "
                            "latency")
    return Link(_number(raw, "bandwidth", f"{where} {key}"),
                _number(raw, "latency", f"{where} {key}", positive=False))


def profile_from_dict(raw: object, where: str) -> ClusterProfile:
    """Validate a profile read from a file: every malformed field is named in one line."""
    if not isinstance(raw, dict):
        raise MeshtronError(f"profile {where} must be a JSON object")
    known = {f.name for f in dataclasses.fields(ClusterProfile)}
    if unknown := sorted(set(raw) - known):
        raise MeshtronError(f"profile {where}: unknown field '{unknown[0]}' (fields: "
                            f"{', '.join(sorted(known))})")
    for key in ("name", "source"):
        if not isinstance(raw.get(key), str):
            raise MeshtronError(f"profile {where}: '{key}' must be a string")
    peaks = raw.get("peak_flops")
    if not isinstance(peaks, dict) or not peaks or set(peaks) - set(DTYPES):
        raise MeshtronError(f"profile {where}: 'peak_flops' must map dtypes ({', '.join(DTYPES)})"
                            " to FLOP/s")
    curve = raw.get("gemm_efficiency", ClusterProfile.gemm_efficiency)
    if (not isinstance(curve, (list, tuple)) or not curve
            or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in curve)):
        raise MeshtronError(f"profile {where}: 'gemm_efficiency' must be a list of "
                            "[gemm_flops, fraction] pairs")
    points = tuple((_number({"f": f}, "f", where), _number({"e": e}, "e", where))
                   for f, e in curve)
    if any(b[0] <= a[0] for a, b in zip(points, points[1:])) or any(e > 1 for _, e in points):
        raise MeshtronError(f"profile {where}: 'gemm_efficiency' must rise in GEMM FLOPs with "
                            "fractions in (0, 1]")
    fits = raw.get("collectives", {})
    if not isinstance(fits, dict) or set(fits) - set(COLLECTIVES):
        raise MeshtronError(f"profile {where}: 'collectives' must map {', '.join(COLLECTIVES)} "
                            "to {group_size: [seconds, seconds_per_byte]}")
    try:
        collectives = {kind: {int(n): (float(a), float(b)) for n, (a, b) in sizes.items()}
                       for kind, sizes in fits.items()}
    except (TypeError, ValueError, AttributeError):
        raise MeshtronError(f"profile {where}: 'collectives' entries must be "
                            "{group_size: [seconds, seconds_per_byte]}") from None
    units = raw.get("compute_units")
    if units is not None and (not isinstance(units, int) or units < 1):
        raise MeshtronError(f"profile {where}: 'compute_units' must be a positive integer")
    sms = raw.get("sm_count")
    if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 1):
        raise MeshtronError(f"profile {where}: 'sm_count' must be a positive integer or null")
    tile = raw.get("gemm_tile", ClusterProfile.gemm_tile)
    if (not isinstance(tile, (list, tuple)) or len(tile) != 3
            or not all(isinstance(t, int) and not isinstance(t, bool) and t > 0 for t in tile)):
        raise MeshtronError(f"profile {where}: 'gemm_tile' must be three positive integers "
                            "[rows, columns, k step]")
    gpus = _number(raw, "gpus_per_node", where)
    if gpus != int(gpus):
        raise MeshtronError(f"profile {where}: 'gpus_per_node' must be a whole number")
    optional = {k: _number(raw, k, where, positive=k.endswith(("correction", "speedup")))
                for k in ("attention_efficiency", "memory_reserved_bytes", "step_overhead_s",
                          "thread_speedup", "time_correction", "memory_correction",
                          "memory_reserved_per_rank_bytes", "compute_correction",
                          "memory_step_slack", "reduce_scatter_copy") if k in raw}
    return ClusterProfile(
        name=raw["name"], source=raw["source"], gpus_per_node=int(gpus),
        memory_bytes=int(_number(raw, "memory_bytes", where)),
        memory_bandwidth=_number(raw, "memory_bandwidth", where),
        peak_flops={k: _number(peaks, k, f"{where} peak_flops") for k in peaks},
        intra_node=_link(raw.get("intra_node"), "intra_node", where),
        inter_node=_link(raw.get("inter_node"), "inter_node", where),
        gemm_efficiency=points, compute_units=units, collectives=collectives,
        sm_count=sms, gemm_tile=tuple(tile),
        **{k: int(v) if k.endswith("bytes") else v for k, v in optional.items()})


def profile_to_dict(profile: ClusterProfile) -> dict:
    raw = dataclasses.asdict(profile)
    raw["gemm_efficiency"] = [list(p) for p in profile.gemm_efficiency]
    raw["gemm_tile"] = list(profile.gemm_tile)
    raw["collectives"] = {kind: {str(n): list(fit) for n, fit in sizes.items()}
                          for kind, sizes in profile.collectives.items()}
    return raw


def save_profile(profile: ClusterProfile, path: Path) -> Path:
    path.write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n")
    return path
