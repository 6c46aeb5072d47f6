"""The optimizer as the training step sees it: data-parallel gradient reduction + AdamW.

``parallel.zero`` picks what each data-parallel rank keeps (N = parameters of its model slice,
fp32, Adam; gradient buckets padded to a multiple of dp):

===========  ==========  ==========  ==================  ===================================
stage        parameters  gradients   optimizer state     communication per step
===========  ==========  ==========  ==================  ===================================
0 (DDP)      4N          4N          8N (two moments)    all-reduce of the gradients
1            4N          4N          8N / dp             reduce-scatter + all-gather
2            4N          4N / dp     8N / dp             reduce-scatter per micro-batch + all-gather
3            4N / dp     4N / dp     8N / dp             + parameter all-gathers per block,
                                                         forward and backward
===========  ==========  ==========  ==================  ===================================

With a single data-parallel rank there is nothing to shard: any stage runs as stage 0.
fp32 parameters are their own master weights (the rank's shard is updated in place);
bf16/fp16 parameters (2N) always get fp32 master weights (4N, sharded like the moments), so
stage 0 then runs the same flat-buffer AdamW as the sharded stages, on whole buckets.

Two classes behind one interface: :class:`ReplicatedOptimizer` (torch's fused AdamW on the
whole model: stage 0 in fp32 or fp64) and :class:`ShardedOptimizer` (flat buffers of which each
rank updates its shard: every other case). :func:`build_optimizer` picks one. Both say what they
hold through :meth:`DataParallelOptimizer.held_tensors`, which is all a checkpoint reads. A
one-process fp32 run has nothing to reduce: its gradients stay in ``.grad``
(:class:`LocalGradients`, no buckets and no hooks), with the same numbers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from meshtron.config import TrainConfig
from meshtron.models.init import lr_multipliers
from meshtron.optim.adamw import build_adamw, set_learning_rate
from meshtron.optim.flat_params import FlatParams
from meshtron.optim.grad_buckets import Bucket, GradReducer
from meshtron.optim.local_grads import LocalGradients
from meshtron.optim.param_sharding import ShardedUnits
from meshtron.optim.sharded_adamw import MOMENTS, ShardedAdamW
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.tensor.collectives import all_reduce
from meshtron.precision.policy import at_least_fp32


@dataclass
class HeldState:
    """A flat range of one parameter-shaped tensor of the training state that this rank holds,
    aliasing live storage (a checkpoint loads straight into it)."""

    kind: str
    """``param``, or an optimizer state: ``exp_avg``, ``exp_avg_sq``, ``master``."""
    param: nn.Parameter
    local_shape: tuple[int, ...]
    """Shape of the parameter on this rank (kept: ZeRO-3 empties parameters between uses)."""
    flat: torch.Tensor
    start: int
    """Row-major index in the local tensor of ``flat[0]``."""
    replicated: bool
    """Every rank of the parameter's data-parallel group holds this same range."""


class DataParallelOptimizer(ABC):
    """Gradient buckets reduced over the data-parallel ranks, the global grad norm, clipping,
    and an AdamW step on what this rank owns."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, t: TrainConfig, *, zero_stage: int,
                 bucket_mb: float, reduce_dtype: torch.dtype | None,
                 on_event: Callable[[str, int], None] | None, local: bool = False):
        """``local``: gradients stay in ``.grad`` (:class:`LocalGradients`, one process)."""
        self.mesh = mesh
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.zero_stage = zero_stage
        self._update_fence: Callable[[], None] | None = None
        dtype = reduce_dtype or self.params[0].dtype
        self.reducer: GradReducer | LocalGradients
        if local:
            self.reducer = LocalGradients(self.params, mesh.dp_cp, dtype=dtype)
        else:
            self.reducer = GradReducer(
                self.params, mesh.dp_cp, zero_stage=zero_stage, bucket_bytes=int(bucket_mb * 2**20),
                dtype=dtype, units=self._units(model) if zero_stage == 3 else None,
                on_event=on_event, lr_mults=lr_multipliers(model),
            )

    def _units(self, model: nn.Module) -> list[list[nn.Parameter]]:
        """ZeRO-3's units: each block's trainable parameters, then everything else."""
        blocks = model.blocks()
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        units = [[p for p in block.parameters() if p.requires_grad] for block in blocks]
        return units + [[p for p in self.params if id(p) not in in_blocks]]  # may be empty

    # ------------------------------------------------------------------ one step

    @abstractmethod
    def hold_shared_parameters(self) -> None:
        """Keep the parameters every micro-batch uses available for the whole step (called
        by pipeline schedules, whose micro-batches interleave)."""

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None
        self.reducer.zero_grad()

    def begin_micro_batch(self, last: bool) -> None:
        self.reducer.begin_micro_batch(last)

    def end_micro_batch(self) -> None:
        self.reducer.end_micro_batch()

    def finish_gradients(self, unscale: float = 1.0) -> None:
        """After the last micro-batch: sum replicated parameters' gradients over their groups
        and undo the loss scale."""
        self.reducer.sync_replicated()
        if unscale != 1.0:
            self.reducer.scale_(unscale)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradient, each replicated copy counted once.

        Unsharded, dense gradients are whole on every data-parallel rank and expert gradients
        whole on every expert-data-parallel rank (different experts on each ep rank), so the
        experts' part is summed over ep, then everything over the model's tp x pp ranks (the
        experts' part over pp only when experts are whole and ep folds over tp: etp=1).
        Sharded, every element lives on exactly one rank of the world.
        """
        dense, experts = self.reducer.grad_norm_squared()
        if self.zero_stage > 0:
            return all_reduce(dense + experts, self.mesh.world).sqrt()
        experts = all_reduce(experts, self.mesh.ep)
        if self.mesh.layout.expert_folded_tp > 1:
            return (all_reduce(dense, self.mesh.model) + all_reduce(experts, self.mesh.pp)).sqrt()
        return all_reduce(dense + experts, self.mesh.model).sqrt()

    def clip(self, norm: float, max_norm: float) -> None:
        """Scale gradients so their global norm is at most ``max_norm`` (0 disables)."""
        if max_norm > 0 and norm > max_norm:
            self.reducer.scale_(max_norm / (norm + 1e-6))

    @abstractmethod
    def step(self, lr: float) -> None:
        """Update the weights this rank owns from the reduced gradients."""

    def fence_next_update(self, ready: Callable[[], None]) -> None:
        """Make the next update call ``ready()`` first (it blocks until a background reader
        of the weights and moments, an asynchronous checkpoint's capture, is done with them)."""
        self._update_fence = ready

    def update(self, lr: float) -> None:
        """:meth:`step`, once the fence set by :meth:`fence_next_update` (if any) is passed:
        until then forward and backward run beside the reader, which only the update races."""
        fence, self._update_fence = self._update_fence, None
        if fence is not None:
            fence()
        self.step(lr)

    # ------------------------------------------------------------------ state

    @abstractmethod
    def init_state(self) -> None:
        """Create zero optimizer state where none exists yet (before a checkpoint is loaded
        into it)."""

    @property
    @abstractmethod
    def steps_taken(self) -> int:
        """Optimizer steps so far (Adam's bias correction depends on it)."""

    @steps_taken.setter
    @abstractmethod
    def steps_taken(self, steps: int) -> None: ...

    @abstractmethod
    def masters_from_params(self) -> None:
        """Reset fp32 master weights from the parameters (after loading parameters)."""

    @abstractmethod
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: parameters, gradients, fp32 master weights
        (none when the parameters are fp32 and unsharded) and the Adam moments."""

    @abstractmethod
    def held_tensors(self, model: nn.Module) -> list[HeldState]:
        """Everything of ``model`` and of this optimizer that this rank holds, in a fixed
        order: what a checkpoint saves and loads."""


class ReplicatedOptimizer(DataParallelOptimizer):
    """ZeRO-0 with fp32 (or fp64) parameters: torch's AdamW over the whole model, gradients
    pointed at the all-reduced buckets, or left in ``.grad`` when ``local``."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, t: TrainConfig, *,
                 bucket_mb: float, reduce_dtype: torch.dtype | None = None,
                 on_event: Callable[[str, int], None] | None = None, local: bool = False):
        super().__init__(model, mesh, t, zero_stage=0, bucket_mb=bucket_mb,
                         reduce_dtype=reduce_dtype, on_event=on_event, local=local)
        self.adamw = build_adamw(model, t, fused=True)  # one pass per tensor, not ~6

    def hold_shared_parameters(self) -> None:
        """Every parameter stays whole: nothing to hold."""

    def step(self, lr: float) -> None:
        self.reducer.point_param_grads()  # torch's AdamW reads .grad
        set_learning_rate(self.adamw, lr)
        self.adamw.step()

    def init_state(self) -> None:
        """torch's AdamW makes its state lazily at the first step; make it now."""
        for param in (p for group in self.adamw.param_groups for p in group["params"]):
            state = self.adamw.state[param]  # created in torch's own order of first use
            if not state:
                state["step"] = _step_count(param, 0)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param,
                                                       memory_format=torch.preserve_format)

    @property
    def steps_taken(self) -> int:
        state = self.adamw.state.get(self.params[0], {})
        return int(state["step"]) if "step" in state else 0

    @steps_taken.setter
    def steps_taken(self, steps: int) -> None:
        self.init_state()
        for param in self.params:
            self.adamw.state[param]["step"] = _step_count(param, steps)

    def masters_from_params(self) -> None:
        """No master weights: the parameters are the weights AdamW updates."""

    def memory_bytes(self) -> dict[str, int]:
        params = sum(p.numel() * p.element_size() for p in self.params)
        moments = sum(v.numel() * v.element_size() for s in self.adamw.state.values()
                      for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
        return {"params": params, "grads": self.reducer.grad_bytes(), "master": 0,
                "optimizer": moments}

    def held_tensors(self, model: nn.Module) -> list[HeldState]:
        out = [_whole("param", p, p.data) for p in model.parameters()]
        for param, state in self.adamw.state.items():
            out += [_whole(key, param, state[key]) for key in MOMENTS if key in state]
        return out


class ShardedOptimizer(DataParallelOptimizer):
    """Flat parameter buffers per gradient bucket, each rank updating its shard with fp32
    masters and moments (ZeRO 1-3; and ZeRO-0 for bf16/fp16 parameters, on whole buckets)."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, t: TrainConfig, *, zero_stage: int,
                 bucket_mb: float, reduce_dtype: torch.dtype | None = None,
                 on_event: Callable[[str, int], None] | None = None):
        super().__init__(model, mesh, t, zero_stage=zero_stage, bucket_mb=bucket_mb,
                         reduce_dtype=reduce_dtype, on_event=on_event)
        self.flats = [FlatParams(b, sharded=zero_stage == 3, whole=zero_stage == 0)
                      for b in self.reducer.buckets]
        self.adamw = ShardedAdamW(self.reducer, self.flats, t)
        self.units = (ShardedUnits(model, model.blocks(), self.flats, self.reducer)
                      if zero_stage == 3 else None)

    def hold_shared_parameters(self) -> None:
        """ZeRO-3 under a pipeline schedule: keep the parameters outside the blocks (embedding,
        final norm, output layer) gathered for the whole step, as micro-batches interleave."""
        if self.units is not None:
            self.units.hold_root = True

    def step(self, lr: float) -> None:
        self.adamw.step(lr)
        if self.units is not None:  # nothing gathered before the update may be reused
            self.units.free_all()

    def init_state(self) -> None:
        """The state exists from the start."""

    @property
    def steps_taken(self) -> int:
        return self.adamw.steps

    @steps_taken.setter
    def steps_taken(self, steps: int) -> None:
        self.adamw.steps = steps

    def masters_from_params(self) -> None:
        for flat, master in zip(self.flats, self.adamw.master):
            if master is not flat.shard:
                master.copy_(flat.shard)

    def memory_bytes(self) -> dict[str, int]:
        params = sum(flat.nbytes() for flat in self.flats)
        return {"params": params, "grads": self.reducer.grad_bytes(), **self.adamw.state_bytes()}

    def held_tensors(self, model: nn.Module) -> list[HeldState]:
        out: list[HeldState] = []
        whole = list(model.parameters())
        if self.units is not None:  # ZeRO-3: each rank holds its shard of the parameters
            for flat in self.flats:
                out += _bucket_ranges("param", flat.bucket, flat.shard, flat.start, False)
            whole = [p for p in whole if not p.requires_grad]  # not in the buckets
        out += [_whole("param", p, p.data) for p in whole]
        for flat, master, moments in zip(self.flats, self.adamw.master, self.adamw.moments):
            states = dict(moments)
            if master.dtype != flat.shard.dtype:
                states["master"] = master
            for kind, shard in states.items():
                out += _bucket_ranges(kind, flat.bucket, shard, flat.start, self.zero_stage == 0)
        return out


def _step_count(param: nn.Parameter, steps: int) -> torch.Tensor:
    """AdamW's step count as its fused kernel keeps it: fp32, on the parameter's device."""
    return torch.tensor(float(steps), dtype=torch.float32, device=param.device)


def _whole(kind: str, param: nn.Parameter, tensor: torch.Tensor) -> HeldState:
    return HeldState(kind, param, tuple(tensor.shape), tensor.view(-1), 0, True)


def _bucket_ranges(kind: str, bucket: Bucket, shard: torch.Tensor, shard_start: int,
                   replicated: bool) -> list[HeldState]:
    """Per parameter of ``bucket``: the part of this rank's shard (bucket elements
    shard_start.. shard_start + len(shard)) that belongs to it."""
    out = []
    shard_end = shard_start + shard.numel()
    for i, param in enumerate(bucket.params):
        lo = max(shard_start, bucket.offsets[i])
        hi = min(shard_end, bucket.offsets[i] + bucket.shapes[i].numel())
        if lo < hi:
            out.append(HeldState(kind, param, tuple(bucket.shapes[i]),
                                 shard[lo - shard_start : hi - shard_start],
                                 lo - bucket.offsets[i], replicated))
    return out


def build_optimizer(model: nn.Module, mesh: ParallelMesh, t: TrainConfig, *, zero: int,
                    bucket_mb: float, reduce_dtype: torch.dtype | None = None,
                    on_event: Callable[[str, int], None] | None = None
                    ) -> DataParallelOptimizer:
    """The optimizer for ``parallel.zero`` on this mesh (stage 0 when dp x cp is one rank).

    A one-process fp32 run reduces nothing, so it keeps no gradient buckets (``local``); fp64
    runs, which verify the math and not the speed, keep them, so that a one-process fp64 run
    exercises the same bucket path as the multi-rank runs it is compared with. So do runs
    that round gradients to another ``reduce_dtype``, or that watch bucket events
    (``on_event``)."""
    zero_stage = zero if mesh.dp_cp.size > 1 else 0
    dtype = next(p.dtype for p in model.parameters() if p.requires_grad)
    if zero_stage == 0 and at_least_fp32(dtype) == dtype:
        local = (mesh.layout.world_size == 1 and dtype == torch.float32
                 and reduce_dtype in (None, dtype) and on_event is None)
        return ReplicatedOptimizer(model, mesh, t, bucket_mb=bucket_mb,
                                   reduce_dtype=reduce_dtype, on_event=on_event, local=local)
    return ShardedOptimizer(model, mesh, t, zero_stage=zero_stage, bucket_mb=bucket_mb,
                            reduce_dtype=reduce_dtype, on_event=on_event)
