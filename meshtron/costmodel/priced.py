"""What the estimator reads besides the problem (the :class:`Software` a run uses) and what it
returns (an :class:`Estimate` per layout, :class:`ActionCosts` per pipeline chunk)."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.memory_model import MemoryEstimate


@dataclass(frozen=True)
class Software:
    """What the training software overlaps and fuses. The defaults are meshtron's own trainer;
    published runs of other software (:mod:`meshtron.costmodel.published`) say theirs."""

    grad_reduce_overlap: bool = True
    """The data-parallel reduction starts during the last backward (bucketed)."""
    param_gather_overlap: bool = False
    """ZeRO 1/2's gather of updated parameters runs behind the next step's first forward
    (Megatron's ``--overlap-param-gather``); meshtron gathers after the optimizer step."""
    fused_attention: bool = True
    """A fused (flash) attention core; else the score matrices are products and memory-bound
    softmax and dropout passes (Megatron-LM before 2022)."""
    attention_efficiency: float | None = None
    """The fused core's fraction of peak where the software's kernel differs from the one the
    profile assumes (PyTorch's SDPA runs FlashAttention-2 on an H100, below cuDNN's and
    FlashAttention-3's rate); None: the profile's."""
    selective: str = "core"
    """What ``selective`` recompute recomputes (:mod:`meshtron.costmodel.recompute`): ``core``
    the attention core (Megatron-LM, meshtron), ``ops`` TorchTitan's per-op policy (every
    second matmul and the memory-bound operators), ``layers`` every ``selective_every``-th
    block whole (TorchTitan's layer-level option)."""
    selective_every: int = 2
    """Under ``selective = "layers"``: one block in this many is checkpointed."""


@dataclass
class Estimate:
    candidate: Candidate
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    memory: MemoryEstimate
    fits: bool
    bottleneck: str
    breakdown: dict[str, float] = field(default_factory=dict)
    """Seconds per step by cause: compute, bubble, tp/cp/ep/pp communication that the
    pipeline waits for, exposed dp communication, the optimizer, fixed overhead."""

    @property
    def memory_per_gpu_bytes(self) -> int:
        return int(self.memory.peak)

    def row(self) -> dict:
        """The JSON entry of the contract."""
        c = self.candidate
        return {"tp": c.tp, "cp": c.cp, "pp": c.pp, "vpp": c.vpp, "schedule": c.schedule,
                "ep": c.ep, "etp": c.etp, "dp": c.dp, "zero": c.zero, "sp": c.sp,
                "micro_batch": c.micro_batch, "recompute": c.recompute,
                "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
                "memory_per_gpu_bytes": self.memory_per_gpu_bytes, "fits": self.fits,
                "bottleneck": self.bottleneck,
                "breakdown_s": {k: round(v, 9) for k, v in self.breakdown.items()}}


@dataclass(frozen=True)
class ActionCosts:
    """Seconds of one chunk's actions for one micro-batch, and the communication inside."""

    forward: float
    backward: float
    """The input-gradient backward (with a whole backward, ``backward + weight``)."""
    weight: float
    """The weight gradients, which zb-h1 defers to their own action."""
    communication: float

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.weight
