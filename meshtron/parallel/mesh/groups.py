"""``ParallelMesh``: this rank's coordinates and its process groups on every axis.

The mesh is built once per run and passed explicitly to whatever communicates; there is no
module-level state. Axes of size one get no process group at all, so every collective on them
is a no-op and a one-process run never touches ``torch.distributed``.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist

from meshtron.parallel.mesh.layout import MeshLayout


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

    @functools.cached_property
    def backend(self) -> str | None:
        """The process group's backend ('gloo', 'nccl'), None without one (asked once: the
        small collectives choose their algorithm by it)."""
        return None if self.pg is None else str(dist.get_backend(self.pg))


class ParallelMesh:
    """This rank's coordinates and one :class:`Group` per axis and axis product.

    ``tp``, ``cp``, ``dp``, ``pp``: the four axes; ``dp_cp``: the ranks that hold replicas of
    the same model slice (gradients are summed over it); ``tp_cp``: the ranks that see parts of
    the same tokens of one model slice; ``model``: the tp x pp ranks that
    together hold one full copy of the model; ``world``: everyone; ``ep`` and ``edp``: the
    expert-parallel and expert-data-parallel groups folded out of dp x cp.
    """

    AXES = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "dp_cp": ("dp", "cp"),
            "model": ("tp", "pp"), "world": ("tp", "cp", "dp", "pp")}

    def __init__(self, layout: MeshLayout, rank: int, stats: CommStats | None = None):
        self.layout = layout
        self.global_rank = rank
        self.stats = stats or CommStats()
        self.coords = layout.coords(rank)
        self._subgroups: dict[int, Group] = {}
        self.tp, self.cp, self.dp, self.pp, self.dp_cp, self.model, self.world = (
            self._make(name, layout.groups(axes)) for name, axes in self.AXES.items())
        self.tp_cp = (self.tp if layout.cp == 1
                      else self._make("tp_cp", layout.groups(("tp", "cp"))))
        """The ranks that share one sequence's tokens of a model slice (FP8 amaxes agree over
        them); the tp group itself without context parallelism."""
        ep_groups, edp_groups = layout.expert_groups()
        self.ep = self._make("ep", ep_groups)
        self.edp = self._make("edp", edp_groups)
        pp_groups = layout.groups(("pp",))
        self.pipeline_ends = self._make(
            "pp_ends", [[g[0], g[-1]] for g in pp_groups] if layout.pp > 1 else [])
        """First and last stage of this rank's pipeline (they share tied embeddings); just this
        rank, without a process group, on the stages between."""
        self.pp_sends, self.pp_receives = self._make_links(pp_groups)
        """Per neighbouring stage (in the ring of stages), the 2-rank process group that
        carries this rank's messages to it, and the one that carries its messages to this
        rank: one group per direction, so each group's operations are all sends on one side
        and all receives on the other (see :meth:`_make_links`)."""

    @classmethod
    def single(cls) -> ParallelMesh:
        """The mesh of a one-process run."""
        return cls(MeshLayout(world_size=1), rank=0)

    def _make(self, name: str, all_groups: list[list[int]]) -> Group:
        """Create the groups of one kind (collectively, on every rank) and keep ours (a group of
        this rank alone when it is in none)."""
        mine = next((g for g in all_groups if self.global_rank in g), [self.global_rank])
        pg = None
        if any(len(members) > 1 for members in all_groups):
            for members in all_groups:  # every rank must create every group, in order
                created = dist.new_group(members)
                if members == mine:
                    pg = created
        return Group(name, mine, mine.index(self.global_rank), pg, self.stats)

    def _make_links(self, pp_groups: list[list[int]]
                    ) -> tuple[dict[int, dist.ProcessGroup], dict[int, dist.ProcessGroup]]:
        """One process group per ordered pair (sender stage, receiver stage) of neighbours in
        every pipeline, created collectively on every rank; this rank's, by peer stage.

        NCCL runs the operations of one group in order on one stream. With a group shared by
        both directions, a stage's send can queue behind its own receive of a message the
        peer sends only after its own receive, which queued behind that send: a deadlock
        that gloo never shows (tests/test_nccl_rules.py). With one group per direction, a
        group's operations match one for one in the order both sides issue them.
        """
        sends: dict[int, dist.ProcessGroup] = {}
        receives: dict[int, dist.ProcessGroup] = {}
        if self.layout.pp == 1:
            return sends, receives
        pp = self.layout.pp
        for group in pp_groups:
            pairs = dict.fromkeys((a, (a + step) % pp) for a in range(pp) for step in (1, -1))
            for a, b in pairs:
                created = dist.new_group(sorted((group[a], group[b])))
                if group[a] == self.global_rank:
                    sends[b] = created
                elif group[b] == self.global_rank:
                    receives[a] = created
        return sends, receives

    def tp_subgroup(self, size: int) -> Group:
        """Runs of ``size`` consecutive ranks inside the tp group (e.g. ranks sharing a kv head).

        Created on first use; every rank builds the same model, so every rank asks for the same
        subgroups in the same order, as process-group creation requires.
        """
        if size not in self._subgroups:
            tp_groups = self.layout.groups(("tp",))
            runs = [g[i : i + size] for g in tp_groups for i in range(0, len(g), size)]
            self._subgroups[size] = self._make(f"tp{size}", runs)
        return self._subgroups[size]
