"""The optimizer as the training step sees it: data-parallel gradient reduction + AdamW.

``parallel.zero`` picks what each data-parallel rank keeps (N = parameters of its model slice,
fp32, Adam; gradient buckets padded to a multiple of dp):

===========  ==========  ==========  ==================  ===================================
stage        parameters  gradients   optimizer state     communication per step
===========  ==========  ==========  ==================  ===================================
0 (DDP)      4N          4N          8N (two moments)    all-reduce of the gradients
1            4N          4N          12N / dp (+master)  reduce-scatter + all-gather
2            4N          4N / dp     12N / dp            reduce-scatter per micro-batch + all-gather
3            4N / dp     4N / dp     12N / dp            + parameter all-gathers per block,
                                                         forward and backward
===========  ==========  ==========  ==================  ===================================

With a single data-parallel rank there is nothing to shard: any stage runs as stage 0.
bf16/fp16 parameters (2N) always get fp32 master weights (4N, sharded like the moments), so
stage 0 then runs the same flat-buffer AdamW as the sharded stages, on whole buckets.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshtron.config import TrainConfig
from meshtron.optim.adamw import build_adamw, set_learning_rate
from meshtron.optim.flat_params import FlatParams
from meshtron.optim.grad_buckets import GradReducer
from meshtron.optim.param_sharding import ShardedUnits
from meshtron.optim.sharded_adamw import ShardedAdamW
from meshtron.parallel.collectives import all_reduce
from meshtron.parallel.mesh import ParallelMesh


class DataParallelOptimizer:
    def __init__(self, model: nn.Module, mesh: ParallelMesh, t: TrainConfig, *, zero: int,
                 bucket_mb: float, reduce_dtype: torch.dtype | None = None,
                 on_event: Callable[[str, int], None] | None = None):
        self.mesh = mesh
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.stage = zero if mesh.dp_cp.size > 1 else 0
        blocks = model.blocks() if self.stage == 3 else []
        units = None
        if blocks:
            in_blocks = {id(p) for block in blocks for p in block.parameters()}
            units = [[p for p in block.parameters() if p.requires_grad] for block in blocks]
            units.append([p for p in self.params if id(p) not in in_blocks])  # may be empty
        self.reducer = GradReducer(
            self.params, mesh.dp_cp, stage=self.stage, bucket_bytes=int(bucket_mb * 2**20),
            dtype=reduce_dtype or self.params[0].dtype, units=units, on_event=on_event,
        )
        self.flats: list[FlatParams] = []
        self.units: ShardedUnits | None = None
        self.low_precision = self.params[0].dtype != torch.float32
        if self.stage == 0 and not self.low_precision:
            self.adamw: torch.optim.AdamW | ShardedAdamW = build_adamw(model, t)
        else:  # ZeRO, or bf16/fp16 parameters that need fp32 master weights
            self.flats = [FlatParams(b, sharded=self.stage == 3, whole=self.stage == 0)
                          for b in self.reducer.buckets]
            self.adamw = ShardedAdamW(self.reducer, self.flats, t)
        if blocks:
            self.units = ShardedUnits(model, blocks, self.flats, self.reducer)

    def hold_shared_parameters(self) -> None:
        """ZeRO-3 under a pipeline schedule: keep the parameters outside the blocks (embedding,
        final norm, output layer) gathered for the whole step, as micro-batches interleave."""
        if self.units is not None:
            self.units.hold_root = True

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
            self.reducer.scale_(torch.tensor(unscale))

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradient, each replicated copy counted once.

        Unsharded, dense gradients are whole on every data-parallel rank and expert gradients
        whole on every expert-data-parallel rank (different experts on each ep rank), so the
        experts' part is summed over ep, then everything over the model's tp x pp ranks (the
        experts' part over pp only when experts are whole and ep folds over tp: etp=1).
        Sharded, every element lives on exactly one rank of the world.
        """
        dense, experts = self.reducer.grad_norm_squared()
        if self.stage > 0:
            return all_reduce(dense + experts, self.mesh.world).sqrt()
        experts = all_reduce(experts, self.mesh.ep)
        if self.mesh.layout.expert_folded_tp > 1:
            return (all_reduce(dense, self.mesh.model) + all_reduce(experts, self.mesh.pp)).sqrt()
        return all_reduce(dense + experts, self.mesh.model).sqrt()

    def clip(self, norm: float, max_norm: float) -> None:
        """Scale gradients so their global norm is at most ``max_norm`` (0 disables)."""
        if max_norm > 0 and norm > max_norm:
            self.reducer.scale_(torch.tensor(max_norm / (norm + 1e-6)))

    def step(self, lr: float) -> None:
        if isinstance(self.adamw, ShardedAdamW):
            self.adamw.step(lr)
            if self.units is not None:  # nothing gathered before the update may be reused
                self.units.free_all()
            return
        for bucket in self.reducer.buckets:  # torch's AdamW reads .grad: point it at the buffers
            for i, param in enumerate(bucket.params):
                param.grad = bucket.view(bucket.grad, i).to(param.dtype)  # a copy if bf16
        set_learning_rate(self.adamw, lr)
        self.adamw.step()

    # ------------------------------------------------------------------ checkpoints, memory

    def init_state(self) -> None:
        """Create zero optimizer state where none exists yet (before a checkpoint is loaded
        into it: torch's AdamW makes its state lazily at the first step)."""
        if isinstance(self.adamw, ShardedAdamW):
            return
        for param in (p for group in self.adamw.param_groups for p in group["params"]):
            state = self.adamw.state[param]  # created in torch's own order of first use
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param,
                                                       memory_format=torch.preserve_format)

    @property
    def steps_taken(self) -> int:
        """Optimizer steps so far (Adam's bias correction depends on it)."""
        if isinstance(self.adamw, ShardedAdamW):
            return self.adamw.steps
        state = self.adamw.state.get(self.params[0], {})
        return int(state["step"]) if "step" in state else 0

    @steps_taken.setter
    def steps_taken(self, steps: int) -> None:
        if isinstance(self.adamw, ShardedAdamW):
            self.adamw.steps = steps
            return
        self.init_state()
        for param in self.params:
            self.adamw.state[param]["step"] = torch.tensor(float(steps))

    def masters_from_params(self) -> None:
        """Reset the fp32 master chunks from the parameters (after loading parameters)."""
        if isinstance(self.adamw, ShardedAdamW):
            for flat, master in zip(self.flats, self.adamw.master):
                master.copy_(flat.chunk)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank keeps between steps: parameters, gradients, fp32 master weights
        (none when the parameters are fp32 and unsharded) and the Adam moments."""
        grads = self.reducer.grad_bytes()
        if isinstance(self.adamw, ShardedAdamW):
            params = sum(flat.nbytes() for flat in self.flats)
            return {"params": params, "grads": grads, **self.adamw.state_bytes()}
        params = sum(p.numel() * p.element_size() for p in self.params)
        moments = sum(v.numel() * v.element_size() for s in self.adamw.state.values()
                      for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
        return {"params": params, "grads": grads, "master": 0, "optimizer": moments}
