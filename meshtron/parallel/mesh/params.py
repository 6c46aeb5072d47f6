"""How a parameter relates to the global model: the one fact about the layout that
initialisation, the optimizer, the grad norm and checkpoints read.

A layer that creates a parameter gives it a :class:`ParamLayout` (with :func:`set_layout`);
everything else reads it with :func:`layout_of`. Parameters are named globally by the module
tree (``layers.3.mlp.gate_up.weight`` with the global layer index on whichever pipeline stage
holds layer 3), so the name is stored only where it differs: on the last stage's copy of a tied
embedding.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from meshtron.parallel.mesh.groups import Group

_ATTRIBUTE = "meshtron_layout"


@dataclass(frozen=True)
class SliceSpec:
    """The slice of a global tensor held by one rank.

    The tensor is viewed as ``parts`` equal blocks along ``dim`` (fused projections such as
    [gate | up]); each block is cut into ``count`` equal pieces and this rank holds piece
    ``index`` of every block, concatenated.
    """

    dim: int
    index: int
    count: int
    parts: int = 1

    def take(self, full: torch.Tensor) -> torch.Tensor:
        blocks = full.chunk(self.parts, dim=self.dim)
        return torch.cat([b.chunk(self.count, dim=self.dim)[self.index] for b in blocks],
                         dim=self.dim)

    def local_shape(self, global_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(global_shape)
        shape[self.dim] //= self.count
        return tuple(shape)


@dataclass(frozen=True)
class ParamLayout:
    """One parameter's place in the global model."""

    global_shape: tuple[int, ...]
    """Shape of the full tensor."""
    tp_slice: SliceSpec | None = None
    """The slice held here; None when the parameter is not split."""
    replicas: int = 1
    """Tensor-parallel ranks holding an identical copy (counted once in grad norms, written
    once in checkpoints)."""
    grad_sync: Group | None = None
    """Group over which the gradient is summed after backward: replicated weights that saw only
    part of the data (norms under sequence parallelism, kv heads shared by several tp ranks),
    or the two pipeline ends' copies of a tied embedding."""
    data_parallel: Group | None = None
    """The ranks whose gradients are summed (and ZeRO-sharded) for this parameter; None is the
    mesh's dp x cp. MoE experts use their expert-data-parallel group."""
    pipeline_copies: int = 1
    """Pipeline stages holding a copy (2 for a tied embedding split over stages)."""
    global_name: str | None = None
    """Set only on a copy named differently from its module path (the last stage's copy of a
    tied embedding is ``embed.weight``): initialised and loaded as that tensor, never saved."""

    def __post_init__(self) -> None:
        if self.grad_sync is not None and self.grad_sync.pg is None:  # a group of one
            object.__setattr__(self, "grad_sync", None)

    @property
    def copies(self) -> int:
        """Ranks of one model replica holding this same tensor."""
        return self.replicas * self.pipeline_copies

    @property
    def is_copy(self) -> bool:
        return self.global_name is not None

    def local_shape(self) -> tuple[int, ...]:
        return self.global_shape if self.tp_slice is None else self.tp_slice.local_shape(
            self.global_shape)


def set_layout(param: nn.Parameter, layout: ParamLayout) -> nn.Parameter:
    """Give ``param`` its layout (once, where the parameter is made)."""
    setattr(param, _ATTRIBUTE, layout)
    return param


def layout_of(param: torch.Tensor) -> ParamLayout:
    """The layout given with :func:`set_layout`."""
    layout = getattr(param, _ATTRIBUTE, None)
    if layout is None:
        raise AssertionError(f"a parameter of shape {tuple(param.shape)} has no ParamLayout: "
                             "every layer gives its parameters one (set_layout)")
    return layout


def tie_across_pipeline(param: nn.Parameter, ends: Group, copy_of: str | None) -> None:
    """Mark one of the two pipeline ends' copies of a tied weight: gradients summed over
    ``ends``, counted once; ``copy_of`` names the tensor the second copy stands for."""
    set_layout(param, dataclasses.replace(layout_of(param), pipeline_copies=2, grad_sync=ends,
                                          global_name=copy_of))


def global_names(model: nn.Module) -> dict[int, str]:
    """``id(param)`` -> the global tensor each parameter of ``model`` holds (part of)."""
    return {id(p): layout_of(p).global_name or name for name, p in model.named_parameters()}
