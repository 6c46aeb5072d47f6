"""What the user fixed for a plan: the model, the batch, the precision and the cluster."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from meshtron.config import ModelConfig
from meshtron.models.flops import training_flops_per_token
from meshtron.tuning.profiles import ClusterProfile

ELEMENT_SIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}


@dataclass(frozen=True)
class Problem:
    """What the user fixed: the model, the batch, the precision and the cluster."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    profile: ClusterProfile
    gpus: int
    dtype: str = "bf16"
    fp8: bool = False
    reduce_dtype: str = "fp32"
    cp_comm: str = "ring"

    @property
    def element_size(self) -> int:
        return ELEMENT_SIZE[self.dtype]

    @property
    def reduce_size(self) -> int:
        return 8 if self.dtype == "fp64" else ELEMENT_SIZE[self.reduce_dtype]

    @property
    def memory_limit(self) -> float:
        """What one rank may use: a GPU's memory, or a CPU rank's share of the host's."""
        p = self.profile
        if p.compute_units is None:
            return p.memory_bytes
        return p.memory_bytes / min(self.gpus, p.gpus_per_node)

    @property
    def gemm_dtype(self) -> str:
        return "fp8" if self.fp8 and "fp8" in self.profile.peak_flops else self.dtype

    @cached_property
    def flops_per_step(self) -> float:
        """Model FLOPs of one optimizer step, Megatron's way (no recompute)."""
        return training_flops_per_token(self.model, self.seq_len) * self.global_batch \
            * self.seq_len
