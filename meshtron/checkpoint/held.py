"""What part of each global tensor of the training state this rank holds, and writes.

Global tensors are named ``model/<parameter>`` and ``optim/<parameter>/<state>`` (``exp_avg``,
``exp_avg_sq``, and ``master`` when parameters are not fp32), with layout-free parameter names.
A rank holds a flat range of a parameter-shaped tp-local tensor: all of it (parameters under
ZeRO 0-2, AdamW state under ZeRO 0) or the part inside its chunk of a gradient bucket (ZeRO-3
parameters, the sharded optimizer's state). :class:`Held` aliases the live storage, so the
loader writes straight into the model and the optimizer.

Every element is written by exactly one rank: one of the data-parallel ranks, in turn, for what
all dp ranks replicate (so they share the writing; for MoE experts, the expert-data-parallel
ranks that replicate them), the first of the tp ranks that share a
replicated parameter, and never the last pipeline stage's copy of a tied embedding.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from meshtron.checkpoint.boxes import Box, flat_range_boxes, local_to_global
from meshtron.optim.data_parallel import DataParallelOptimizer
from meshtron.optim.grad_buckets import Bucket
from meshtron.optim.sharded_adamw import ShardedAdamW
from meshtron.parallel.mesh import Group, ParallelMesh


@dataclass
class Held:
    name: str
    param: nn.Parameter
    """Whose geometry applies: ``global_shape`` and ``shard`` (see parallel/tensor.py)."""
    local_shape: tuple[int, ...]
    flat: torch.Tensor
    """This rank's elements, 1-D, aliasing live storage."""
    start: int
    """Row-major index in the tp-local tensor of ``flat[0]``."""
    writes: bool
    fallback: str | None = None
    """Another global tensor to load from when the checkpoint lacks this one (a master weight
    from the saved parameter)."""

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self.param, "global_shape", self.local_shape))

    def boxes(self) -> list[tuple[Box, Box]]:
        """(local box, global box) pairs that together cover ``flat``."""
        out = []
        for box in flat_range_boxes(self.local_shape, self.start, self.start + self.flat.numel()):
            out += local_to_global(box, getattr(self.param, "shard", None), self.global_shape)
        return out

    def view(self, local_box: Box) -> torch.Tensor:
        """The elements of ``local_box`` (which lies in this rank's range) as a tensor view."""
        offset, size = local_box
        if self.start == 0 and self.flat.numel() == math.prod(self.local_shape):
            full = self.flat.view(self.local_shape)
            return full[tuple(slice(o, o + s) for o, s in zip(offset, size))]
        first = _ravel(offset, self.local_shape) - self.start
        assert _contiguous(size, self.local_shape), "flat ranges give row-major boxes"
        return self.flat[first : first + math.prod(size)].view(size)


def _ravel(index: tuple[int, ...], shape: tuple[int, ...]) -> int:
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


def _contiguous(size: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A box of this size is contiguous in row-major order: after its first dimension of
    length > 1, every dimension is whole."""
    for d, s in enumerate(size):
        if s > 1:
            return all(size[k] == shape[k] for k in range(d + 1, len(shape)))
    return True


def global_parameters(model: nn.Module) -> dict[int, str]:
    """``id(param)`` -> global name (a tied copy carries the name of what it copies)."""
    return {id(p): getattr(p, "global_name", n) for n, p in model.named_parameters()}


def _unique_writer(param: nn.Parameter, mesh: ParallelMesh) -> bool:
    """Not a pipeline copy, and the first of the tp ranks sharing a replicated parameter."""
    if getattr(param, "global_name", None) is not None:
        return False
    return mesh.tp.rank % getattr(param, "replicas", 1) == 0


def held_tensors(model: nn.Module, optimizer: DataParallelOptimizer,
                 mesh: ParallelMesh) -> list[Held]:
    """Everything of the model and its optimizer that this rank holds, in a fixed order."""
    names = global_parameters(model)
    turns: dict[str, itertools.count] = {}

    def my_turn(group: Group) -> bool:
        """Round-robin over the data-parallel ranks (dp x cp, or the experts' own group) for
        what they all hold: the write is shared."""
        turn = next(turns.setdefault(group.name, itertools.count()))
        return turn % group.size == group.rank

    def dp_group(param: nn.Parameter) -> Group:
        return getattr(param, "data_parallel", mesh.dp_cp)

    out: list[Held] = []
    sharded = isinstance(optimizer.adamw, ShardedAdamW)
    chunks = optimizer.flats if sharded else []
    whole_params = list(model.parameters())
    if optimizer.units is not None:  # ZeRO-3: each rank holds its chunk of the parameters
        for flat in chunks:
            out += _bucket_ranges("model/{}", names, flat.bucket, flat.chunk, flat.start, mesh)
        whole_params = [p for p in whole_params if not p.requires_grad]  # not in the buckets
    for param in whole_params:
        out.append(Held(f"model/{names[id(param)]}", param, tuple(param.shape),
                        param.data.view(-1), 0,
                        my_turn(dp_group(param)) and _unique_writer(param, mesh)))
    if sharded:
        adamw = optimizer.adamw
        replicated = optimizer.stage == 0  # whole buckets on every dp rank
        for flat, master, moments in zip(chunks, adamw.master, adamw.moments):
            states = dict(moments)
            if flat.chunk.dtype != torch.float32:
                states["master"] = master
            for key, chunk in states.items():
                for held in _bucket_ranges(f"optim/{{}}/{key}", names, flat.bucket, chunk,
                                           flat.start, mesh):
                    held.writes &= not replicated or my_turn(flat.group)
                    if key == "master":
                        held.fallback = "model/" + held.name[len("optim/"):-len("/master")]
                    out.append(held)
    else:
        for param, state in optimizer.adamw.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    out.append(Held(f"optim/{names[id(param)]}/{key}", param, tuple(param.shape),
                                    state[key].view(-1), 0,
                                    my_turn(dp_group(param)) and _unique_writer(param, mesh)))
    return out


def _bucket_ranges(pattern: str, names: dict[int, str], bucket: Bucket, chunk: torch.Tensor,
                   chunk_start: int, mesh: ParallelMesh) -> list[Held]:
    """Per parameter of ``bucket``: the part of this rank's chunk (bucket elements
    chunk_start.. chunk_start + len(chunk)) that belongs to it."""
    out = []
    chunk_end = chunk_start + chunk.numel()
    for i, param in enumerate(bucket.params):
        lo = max(chunk_start, bucket.offsets[i])
        hi = min(chunk_end, bucket.offsets[i] + bucket.shapes[i].numel())
        if lo >= hi:
            continue
        out.append(Held(pattern.format(names[id(param)]), param, tuple(bucket.shapes[i]),
                        chunk[lo - chunk_start : hi - chunk_start], lo - bucket.offsets[i],
                        _unique_writer(param, mesh)))
    return out
