"""What the user fixed for a plan: the model, the batch, the precision and the cluster."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from meshtron.config import Config, ModelConfig
from meshtron.costmodel.gather_formats import gather_formats
from meshtron.costmodel.memory_model import with_vocab
from meshtron.costmodel.profiles import ClusterProfile
from meshtron.errors import MeshtronError
from meshtron.models.flops import training_flops_per_token

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
    fp4: bool = False
    """``precision.fp4=nvfp4``: the blocks' products at the profile's FP4 peak (where it has
    one; else FP8's, else the dtype's)."""
    reduce_dtype: str = "fp32"
    cp_comm: str = "ring"
    tp_comm_chunks: int = 0
    """``parallel.tp_comm_chunks`` when ``parallel.tp_comm_overlap`` is on, else 0."""
    gather_formats: tuple[str, ...] = ()
    """``precision.fp8_param_gather``: each block's format in ZeRO-3's gather (``high``,
    ``fp8``, ``fp4``: :mod:`meshtron.costmodel.gather_formats`); empty: all in ``dtype``."""

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
    def reserved_bytes(self) -> float:
        """What one rank holds besides the model: the runtime, plus each other rank of its
        node's share (gloo's buffers per peer)."""
        p = self.profile
        peers = min(self.gpus, p.gpus_per_node) - 1
        return p.memory_reserved_bytes + p.memory_reserved_per_rank_bytes * peers

    @property
    def gemm_dtype(self) -> str:
        peaks = self.profile.peak_flops
        if self.fp4 and "fp4" in peaks:
            return "fp4"
        return "fp8" if (self.fp8 or self.fp4) and "fp8" in peaks else self.dtype

    @cached_property
    def flops_per_step(self) -> float:
        """Model FLOPs of one optimizer step, Megatron's way (no recompute)."""
        return training_flops_per_token(self.model, self.seq_len) * self.global_batch \
            * self.seq_len


@dataclass(frozen=True)
class Cluster:
    """Where a plan runs: a profile and how many GPUs (or CPU ranks) of it."""

    profile: ClusterProfile
    gpus: int


def problem_of(cfg: Config, cluster: Cluster) -> Problem:
    model = with_vocab(cfg.model, cfg.data.vocab_size)
    if not model.vocab_size:
        raise MeshtronError("model.vocab_size is unset: give --model.vocab_size (the tuner "
                            "reads no tokenizer)")
    return Problem(model, cfg.train.seq_len, cfg.train.global_batch, cluster.profile,
                   cluster.gpus, dtype=cfg.precision.dtype, fp8=cfg.precision.fp8 != "none",
                   fp4=cfg.precision.fp4 != "none",
                   reduce_dtype=cfg.precision.reduce_dtype, cp_comm=cfg.parallel.cp_comm,
                   tp_comm_chunks=(cfg.parallel.tp_comm_chunks if cfg.parallel.tp_comm_overlap
                                   else 0),
                   gather_formats=gather_formats(cfg.precision, model))
