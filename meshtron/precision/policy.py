"""Low precision: bf16/fp16 parameters and activations, fp32 master weights, loss scaling.

With ``precision.dtype`` bf16 or fp16 the model's parameters are stored in that dtype, so the
forward and backward run in it; norms, softmax and the loss compute in fp32 inside their ops.
The optimizer keeps fp32 master weights and moments (sharded under ZeRO) and writes rounded
copies back into the parameters; gradients are reduced in ``precision.reduce_dtype``.

fp64 is for verification: everything, gradient reductions and optimizer state included, stays
in fp64, so layouts that do the same math agree to ~1e-12 and a parity failure cannot hide in
fp32 rounding.

fp16 uses dynamic loss scaling. The scaler decides from the global grad norm, which every rank
computes identically after the reductions, so a step with an overflow is skipped on all ranks
together.
"""

from __future__ import annotations

import torch
from torch import nn

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp64": torch.float64}


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms, softmax, losses and optimizer state compute in: fp32 for fp32 and the
    16-bit formats, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


class LossScaler:
    """Multiply the loss by ``scale``; halve it on overflow, double it after clean stretches."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale = scale
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Precision:
    """The number formats of one run (``precision.*``) and its fp16 loss scaler."""

    def __init__(self, dtype: str, device: torch.device, loss_scaling: bool = True,
                 reduce_dtype: str = "fp32"):
        self.name = dtype
        self.device = device
        self.param_dtype = PARAM_DTYPES[dtype]
        self.reduce_dtype = torch.float64 if dtype == "fp64" else REDUCE_DTYPES[reduce_dtype]
        """What gradient buckets hold and are reduced in (fp64 runs keep fp64 throughout)."""
        self.scaler = LossScaler() if dtype == "fp16" and loss_scaling else None

    def cast_parameters(self, model: nn.Module) -> None:
        """Store ``model``'s trained parameters in the training dtype (buffers such as rotary
        tables, and untrained state such as the MoE routers' expert bias, stay fp32)."""
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(self.param_dtype)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0


NATIVE_CPU_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16", "bf16"),
                    "fp16": ("avx512_fp16", "amx_fp16", "asimdhp")}
"""The CPU flags (x86 AVX-512/AMX; Arm ``bf16`` and ``asimdhp``, as PyTorch checks them, not
measured here) under which PyTorch's oneDNN runs 16-bit matmuls in hardware; without them
``aten::mm`` falls back to a reference GEMM many times slower than fp32's MKL one
(docs/precision.md)."""
CPU_SLOWDOWN = {"bf16": "2-30x", "fp16": "15-35x"}
"""Step time against fp32 measured on the fallback (tiny preset, an AMD EPYC; bf16 with oneDNN
held to AVX-512 without BF16, 2-10x, or to AVX2, 14-30x), see docs/precision.md."""


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_low_precision_note(dtype: str, device: torch.device | str, *,
                           native: bool | None = None) -> str | None:
    """A one-line warning for a bf16/fp16 run on a CPU that lacks hardware 16-bit matmuls (it
    trains many times slower than in fp32 there); None otherwise. ``native``: whether the CPU
    has them (None: read its flags)."""
    if torch.device(device).type != "cpu" or dtype not in NATIVE_CPU_FLAGS:
        return None
    flags = NATIVE_CPU_FLAGS[dtype]
    if native is None:
        native = not cpu_flags().isdisjoint(flags)
    if native:
        return None
    names = "/".join(f.upper().replace("_", "-") for f in flags[:2])
    return (f"precision.dtype={dtype} on a CPU without {names}: its matmuls run on PyTorch's "
            f"slow fallback kernels, measured {CPU_SLOWDOWN[dtype]} slower per step than fp32; "
            f"fp32 is faster here (use {dtype} on GPUs)")
