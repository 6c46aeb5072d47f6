"""``ParallelMesh``: this rank's coordinates and its process groups on every axis.

The mesh is built once per run and passed explicitly to whatever communicates; there is no
module-level state. Axes of size one get no process group at all, so every collective on them
is a no-op and a one-process run never touches ``torch.distributed``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist

from meshtron.parallel.layout import MeshLayout


@dataclass
class CommStats:
    """Bytes sent by this rank, per '<group>/<kind>' (e.g. 'tp/all_reduce'); see
    :mod:`meshtron.parallel.collectives` for how each collective is counted."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, group: str, kind: str, nbytes: int) -> None:
        self.bytes[f"{group}/{kind}"] += nbytes

    def take(self) -> dict[str, int]:
        """The counts so far, then start again from zero (called once per step)."""
        out = dict(self.bytes)
        self.bytes.clear()
        return out


@dataclass
class Group:
    """One process group seen from one of its members."""

    name: str
    ranks: list[int]
    rank: int
    """This process's index within ``ranks``."""
    pg: dist.ProcessGroup | None
    stats: CommStats

    @property
    def size(self) -> int:
        return len(self.ranks)


class ParallelMesh:
    def __init__(self, layout: MeshLayout, rank: int, stats: CommStats | None = None):
        self.layout = layout
        self.global_rank = rank
        self.stats = stats or CommStats()
        self.coords = layout.coords(rank)
        self._groups: dict[str, Group] = {}
        axes = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",),
                "dp_cp": ("dp", "cp"), "model": ("tp", "pp"), "world": ("tp", "cp", "dp", "pp")}
        for name, group_axes in axes.items():
            self._groups[name] = self._make(name, layout.groups(group_axes))
        ep_groups, edp_groups = layout.expert_groups()
        self._groups["ep"] = self._make("ep", ep_groups)
        self._groups["edp"] = self._make("edp", edp_groups)

    @classmethod
    def single(cls) -> ParallelMesh:
        """The mesh of a one-process run."""
        return cls(MeshLayout(world_size=1), rank=0)

    def _make(self, name: str, all_groups: list[list[int]]) -> Group:
        """Create the groups of one kind (collectively, on every rank) and keep ours."""
        mine = next(g for g in all_groups if self.global_rank in g)
        pg = None
        if len(mine) > 1:
            for members in all_groups:  # every rank must create every group, in order
                created = dist.new_group(members)
                if members == mine:
                    pg = created
        return Group(name, mine, mine.index(self.global_rank), pg, self.stats)

    def group(self, name: str) -> Group:
        return self._groups[name]

    def tp_subgroup(self, size: int) -> Group:
        """Runs of ``size`` consecutive ranks inside the tp group (e.g. ranks sharing a kv head).

        Created on first use; every rank builds the same model, so every rank asks for the same
        subgroups in the same order, as process-group creation requires.
        """
        name = f"tp{size}"
        if name not in self._groups:
            tp_groups = self.layout.groups(("tp",))
            runs = [g[i : i + size] for g in tp_groups for i in range(0, len(g), size)]
            self._groups[name] = self._make(name, runs)
        return self._groups[name]

    @property
    def tp(self) -> Group:
        return self._groups["tp"]

    @property
    def cp(self) -> Group:
        return self._groups["cp"]

    @property
    def dp(self) -> Group:
        return self._groups["dp"]

    @property
    def pp(self) -> Group:
        return self._groups["pp"]

    @property
    def dp_cp(self) -> Group:
        return self._groups["dp_cp"]

    @property
    def model(self) -> Group:
        """The tp x pp ranks that together hold one full copy of the model."""
        return self._groups["model"]

    @property
    def world(self) -> Group:
        return self._groups["world"]

    @property
    def ep(self) -> Group:
        return self._groups["ep"]

    @property
    def edp(self) -> Group:
        return self._groups["edp"]

    def describe(self) -> str:
        c, s = self.coords, self.layout.sizes()
        return " ".join(f"{a}={c[a]}/{s[a]}" for a in ("tp", "cp", "dp", "pp"))
