"""Rank arithmetic of the device mesh, without any process groups.

Ranks are laid out with tp innermost, then cp, then dp, then pp outermost::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a tensor-parallel group is a run of consecutive ranks (it stays inside a node), and the
pipeline stages are the coarsest blocks. Expert parallelism folds into the dp x cp ranks of one
(tp, pp) slice (Megatron's "MoE parallel folding"): ep groups are runs of ``ep`` consecutive
ranks of that slice and the expert-data-parallel groups stride across them. With expert tensor
parallelism 1 (``etp=1``, experts whole on every rank while attention is split over tp) the
experts fold into the tp x dp x cp ranks of a pipeline stage instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshtron.errors import MeshtronError

if TYPE_CHECKING:
    from meshtron.config import ParallelConfig

AXES = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class MeshLayout:
    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    """Expert tensor parallelism: None or ``tp`` splits experts over tp, 1 keeps them whole."""
    sp: bool = False
    """Sequence parallelism: the residual stream is split over tp by sequence (with tp > 1)."""
    cp_comm: str = "ring"
    """How attention spans the cp ranks: ring, all_to_all or all_gather (see parallel/context)."""

    def __post_init__(self) -> None:
        model_parallel = self.tp * self.cp * self.pp
        for name in ("tp", "cp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise MeshtronError(f"parallel.{name} must be at least 1")
        if self.world_size % model_parallel:
            raise MeshtronError(
                f"world size {self.world_size} is not divisible by tp*cp*pp = "
                f"{self.tp}*{self.cp}*{self.pp} = {model_parallel}"
            )
        if self.etp not in (None, 1, self.tp):
            raise MeshtronError(f"parallel.etp={self.etp} must be 1 or parallel.tp={self.tp}")
        if (self.dp * self.cp * self.expert_folded_tp) % self.ep:
            raise MeshtronError(expert_fold_message(self.ep, self.dp, self.cp,
                                                    self.expert_folded_tp))

    @property
    def sequence_parallel(self) -> bool:
        return self.sp and self.tp > 1

    @property
    def whole_experts(self) -> bool:
        """Expert tensor parallel 1 with tp > 1: experts whole, each tp rank routes its share."""
        return self.etp == 1 and self.tp > 1

    @property
    def expert_folded_tp(self) -> int:
        """The tp ranks the ep groups fold over: tp when experts are whole (etp=1), else 1."""
        return self.tp if self.etp == 1 else 1

    @classmethod
    def of(cls, parallel: ParallelConfig, world_size: int) -> MeshLayout:
        """The layout ``parallel`` (the config section) asks for on ``world_size`` ranks."""
        p = parallel
        return cls(world_size, p.tp, p.cp, p.pp, p.ep, p.etp, p.sp, p.cp_comm)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def coords(self, rank: int) -> dict[str, int]:
        """The (tp, cp, dp, pp) coordinates of ``rank``."""
        out = {}
        for axis, size in self.sizes().items():
            out[axis] = rank % size
            rank //= size
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        rank, stride = 0, 1
        for axis, size in self.sizes().items():
            rank += coords.get(axis, 0) * stride
            stride *= size
        return rank

    def groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """All groups of ranks that differ only along ``axes`` (every rank in exactly one)."""
        sizes = self.sizes()
        fixed = [a for a in AXES if a not in axes]
        seen: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            seen.setdefault(tuple(c[a] for a in fixed), []).append(rank)
        for members in seen.values():
            assert len(members) == _product(sizes[a] for a in axes)
        return sorted(seen.values())

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """(ep groups, expert-dp groups), both carved out of each dp x cp group (tp x dp x cp
        with etp=1)."""
        ep_groups, edp_groups = [], []
        axes = ("tp", "cp", "dp") if self.expert_folded_tp > 1 else ("cp", "dp")
        for members in self.groups(axes):
            ep_groups += [members[i : i + self.ep] for i in range(0, len(members), self.ep)]
            edp_groups += [members[i :: self.ep] for i in range(self.ep)]
        return sorted(ep_groups), sorted(edp_groups)


def expert_fold_message(ep: int, dp: int, cp: int, tp: int) -> str:
    if tp > 1:
        return (f"parallel.ep={ep} does not divide tp*dp*cp = {tp}*{dp}*{cp}; with "
                "parallel.etp=1 expert parallelism folds into the tensor-, data- and "
                "context-parallel ranks")
    return (f"parallel.ep={ep} does not divide dp*cp = {dp}*{cp}; expert parallelism folds "
            "into the data- and context-parallel ranks")


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out
