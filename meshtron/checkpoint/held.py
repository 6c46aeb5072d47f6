"""What part of each global tensor of the training state this rank holds, and writes.

Global tensors are named ``model/<parameter>`` and ``optim/<parameter>/<state>`` (``exp_avg``,
``exp_avg_sq``, and ``master`` when parameters are not fp32), with layout-free parameter names.
A rank holds a flat range of a parameter-shaped tp-local tensor: all of it (parameters under
ZeRO 0-2, AdamW state under ZeRO 0) or the part inside its chunk of a gradient bucket (ZeRO-3
parameters, the sharded optimizer's state); the optimizer says which
(:meth:`~meshtron.optim.data_parallel.DataParallelOptimizer.held_tensors`). :class:`Held`
aliases the live storage, so the loader writes straight into the model and the optimizer.

Every element is written by exactly one rank: for what all dp ranks replicate, the
data-parallel rank that has written the fewest bytes so far (so they share the writing evenly,
whatever the tensors' sizes; for MoE experts, among the expert-data-parallel ranks that
replicate them), the first of the tp ranks that share a
replicated parameter, and never the last pipeline stage's copy of a tied embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from meshtron.checkpoint.boxes import Box, flat_range_boxes, local_to_global
from meshtron.optim.data_parallel import DataParallelOptimizer, HeldState
from meshtron.parallel.mesh.groups import Group, ParallelMesh
from meshtron.parallel.mesh.params import global_names, layout_of
from meshtron.parallel.tensor.lora import is_frozen_base


@dataclass
class Held:
    name: str
    param: nn.Parameter
    """Whose layout applies: the global shape and the slice held (see parallel/mesh/params.py)."""
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
        return layout_of(self.param).global_shape

    def boxes(self) -> list[tuple[Box, Box]]:
        """(local box, global box) pairs that together cover ``flat``."""
        out = []
        tp_slice = layout_of(self.param).tp_slice
        for box in flat_range_boxes(self.local_shape, self.start, self.start + self.flat.numel()):
            out += local_to_global(box, tp_slice, self.global_shape)
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


def _unique_writer(param: nn.Parameter, mesh: ParallelMesh) -> bool:
    """Not a pipeline copy, and the first of the tp ranks sharing a replicated parameter."""
    layout = layout_of(param)
    return not layout.is_copy and mesh.tp.rank % layout.replicas == 0


def next_writer(written: list[int], nbytes: int) -> int:
    """The rank that writes the next replicated tensor, of ``nbytes``: the one with the fewest
    bytes ``written`` so far (the lowest on a tie), charged for it."""
    writer = written.index(min(written))
    written[writer] += nbytes
    return writer


def held_tensors(model: nn.Module, optimizer: DataParallelOptimizer,
                 mesh: ParallelMesh) -> list[Held]:
    """Everything of the model and its optimizer that this rank holds, in a fixed order."""
    names = global_names(model)
    written: dict[str, list[int]] = {}

    def my_turn(group: Group, nbytes: int) -> bool:
        """Whether this rank writes a tensor that all ranks of ``group`` (dp x cp, or the
        experts' own group) hold. Every rank of the group sees the same tensors in the same
        order, so all agree."""
        return next_writer(written.setdefault(group.name, [0] * group.size), nbytes) \
            == group.rank

    def held(state: HeldState) -> Held:
        name = names[id(state.param)]
        writes = _unique_writer(state.param, mesh)
        if state.replicated:
            group = layout_of(state.param).data_parallel
            nbytes = state.flat.numel() * state.flat.element_size()
            writes = my_turn(mesh.dp_cp if group is None else group, nbytes) and writes
        if state.kind == "param":
            return Held(f"model/{name}", state.param, state.local_shape, state.flat, state.start,
                        writes)
        return Held(f"optim/{name}/{state.kind}", state.param, state.local_shape, state.flat,
                    state.start, writes, f"model/{name}" if state.kind == "master" else None)

    return [held(state) for state in optimizer.held_tensors(model)
            if not is_frozen_base(state.param)]  # an adapted model's base: not its state
