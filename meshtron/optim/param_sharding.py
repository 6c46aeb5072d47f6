"""ZeRO-3: each unit's parameters exist in full only while the unit runs.

Units are the transformer blocks, plus a root unit holding everything else (embedding, final
norm, output layer). Before a block's forward its flat parameters are all-gathered (the next
block's gather is started at the same time, so it overlaps this block's compute) and after the
forward they are freed. Backward gathers them again, prefetching the block before, and frees
them once all of the unit's gradients have been handed to the reduce-scatter. The root unit
stays gathered from the start of the forward pass to the end of the backward pass, as the
embedding is used at both ends when weights are tied.

With ``precision.fp8_param_gather`` the low-precision linear layers' weights travel as E4M3, or
E2M1 for NVFP4 layers (:mod:`meshtron.optim.fp8_gather`): a layer whose low-precision options
carry a :class:`~meshtron.precision.param_gather.WeightGather` (or ``FP4WeightGather``) marks
its weight for it.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtron.autograd import in_backward
from meshtron.optim.flat_params import FlatParams
from meshtron.optim.fp8_gather import FP8Gather
from meshtron.optim.grad_buckets import Bucket, GradReducer
from meshtron.precision.param_gather import FP4WeightGather, WeightGather


class ShardedUnits:
    def __init__(self, model: nn.Module, blocks: list[nn.Module], flats: list[FlatParams],
                 reducer: GradReducer):
        gathers = fp8_gathered_weights(model)
        for flat in flats:
            if any(id(p) in gathers for p in flat.bucket.params):
                flat.fp8 = FP8Gather(flat.bucket, gathers)
        block_of = {id(p): i for i, block in enumerate(blocks) for p in block.parameters()}
        root = len(blocks)
        self.units: list[list[FlatParams]] = [[] for _ in range(root + 1)]
        self.unit_of_bucket: dict[int, int] = {}
        for flat in flats:
            unit = block_of.get(id(flat.bucket.params[0]), root)
            self.units[unit].append(flat)
            self.unit_of_bucket[flat.bucket.index] = unit
        self.pending = [0] * (root + 1)
        self.root = root
        self.hold_root = False
        """Keep the root unit gathered until :meth:`free_all` (pipeline schedules interleave
        micro-batches, so a later backward may still need it after an earlier one ended)."""
        reducer.on_launch = self._bucket_launched
        model.register_forward_pre_hook(lambda m, args: self._enter(root, prefetch=0))
        # a forward recomputed inside backward (activation recompute) must not prefetch
        # the next block: backward walks the other way
        model.register_forward_hook(self._after_model)
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(
                lambda m, args, i=i: self._enter(i, prefetch=-1 if in_backward() else i + 1))
            block.register_forward_hook(lambda m, args, out, i=i: self._after_forward(i))
            block.register_full_backward_pre_hook(
                lambda m, grad, i=i: self._enter(i, prefetch=i - 1))

    def _enter(self, unit: int, prefetch: int) -> None:
        for flat in self.units[unit]:
            flat.wait_gather()
        self.pending[unit] = len(self.units[unit])
        if 0 <= prefetch < self.root:
            for flat in self.units[prefetch]:
                flat.start_gather()

    def _after_forward(self, unit: int) -> None:
        if not in_backward():  # a recomputed forward inside backward keeps its parameters
            self.free(unit)

    def _after_model(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if not torch.is_grad_enabled():  # no backward follows (evaluation)
            self.free(self.root)

    def _bucket_launched(self, bucket: Bucket) -> None:
        unit = self.unit_of_bucket[bucket.index]
        self.pending[unit] -= 1
        if self.pending[unit] == 0 and not (unit == self.root and self.hold_root):
            self.free(unit)

    def free(self, unit: int) -> None:
        for flat in self.units[unit]:
            flat.free()

    def free_all(self) -> None:
        """Free every unit, dropping prefetches (called after the optimizer changed shards)."""
        for unit in range(len(self.units)):
            self.free(unit)


def fp8_gathered_weights(model: nn.Module) -> dict[int, WeightGather | FP4WeightGather]:
    """The weights gathered in FP8 or FP4 (by ``id``): those of linear layers whose
    low-precision options carry a :class:`WeightGather` or :class:`FP4WeightGather`."""
    out = {}
    for module in model.modules():
        gather = getattr(getattr(module, "fp8", None), "gather", None)
        weight = getattr(module, "weight", None)
        if gather is not None and isinstance(weight, nn.Parameter) and weight.requires_grad:
            out[id(weight)] = gather
    return out
