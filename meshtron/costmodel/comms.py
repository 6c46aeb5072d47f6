"""Communication time: an alpha-beta model per link level, and which groups cross nodes.

A ring collective over ``n`` ranks takes ``n-1`` message steps (all-gather, reduce-scatter,
all-to-all) or ``2(n-1)`` (all-reduce) and puts ``(n-1)/n`` (or twice that) of the rank's buffer
on the wire; each step pays the link's latency, each byte its bandwidth. A calibrated profile's
measured fit for a collective and group size (inside one node) replaces the formula.

Which link a group uses follows from the mesh's rank order (:mod:`meshtron.parallel.mesh.layout`:
tp innermost, then cp, dp, pp): a group of ``size`` ranks ``stride`` apart spans
``stride * size`` consecutive ranks, so it stays inside a node of ``gpus_per_node`` when that
span fits in one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.profiles import ClusterProfile

RING_STEPS = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}


@dataclass(frozen=True)
class PricedGroup:
    """A process group of a layout: its size and whether it reaches across nodes."""

    size: int
    crosses_nodes: bool
    per_node: int = 1
    """Ranks of the group in one node. A ring through them crosses each node's boundary once
    per ``per_node`` hops, and their ``per_node`` network cards carry the group's traffic out
    of the node, so a rank moves its buffer at ``per_node`` times one card's bandwidth (up to
    the node's own link)."""


def priced_group(size: int, stride: int, gpus_per_node: int) -> PricedGroup:
    crosses = size > 1 and stride * size > gpus_per_node
    per_node = max(1, min(size, gpus_per_node // stride)) if crosses else size
    return PricedGroup(size, crosses, per_node)


@dataclass(frozen=True)
class LayoutGroups:
    tp: PricedGroup
    cp: PricedGroup
    dp: PricedGroup
    """The dense parameters' gradient group: dp x cp ranks (cp ranks hold the same weights)."""
    ep: PricedGroup
    expert_dp: PricedGroup
    pp_crosses_nodes: bool


def layout_groups(c: Candidate, gpus_per_node: int) -> LayoutGroups:
    """The candidate's groups; cached on the fields they read, not the whole candidate (a
    search asks for every micro-batch size and recompute mode of each layout)."""
    return _groups(c.tp, c.cp, c.pp, c.dp, c.ep, c.etp, gpus_per_node)


@lru_cache(maxsize=4096)
def _groups(tp: int, cp: int, pp: int, dp: int, ep: int, etp: int | None,
            gpus_per_node: int) -> LayoutGroups:
    folded_tp = tp if etp == 1 else 1  # etp=1: experts fold over the tp ranks too
    ep_stride = 1 if etp == 1 else tp
    expert_dp = dp * cp * folded_tp // ep
    return LayoutGroups(
        tp=priced_group(tp, 1, gpus_per_node),
        cp=priced_group(cp, tp, gpus_per_node),
        dp=priced_group(dp * cp, tp, gpus_per_node),
        ep=priced_group(ep, ep_stride, gpus_per_node),
        expert_dp=priced_group(expert_dp, ep_stride * ep, gpus_per_node),
        pp_crosses_nodes=pp > 1 and tp * cp * dp >= gpus_per_node)


def collective_seconds(profile: ClusterProfile, kind: str, group: PricedGroup,
                       nbytes: float) -> float:
    """Time of one collective of ``kind`` whose per-rank buffer is ``nbytes`` (the tensor of an
    all-reduce, the gathered output of an all-gather, the input of a reduce-scatter or an
    all-to-all)."""
    n = group.size
    if n <= 1 or nbytes <= 0:
        return 0.0
    fit = None if group.crosses_nodes else profile.collectives.get(kind, {}).get(n)
    if fit is not None:
        return fit[0] + fit[1] * nbytes
    link = profile.inter_node if group.crosses_nodes else profile.intra_node
    bandwidth = min(profile.intra_node.bandwidth, group.per_node * link.bandwidth) \
        if group.crosses_nodes else link.bandwidth
    factor = RING_STEPS[kind]
    return factor * (n - 1) * link.latency + factor * (n - 1) / n * nbytes / bandwidth


def send_seconds(profile: ClusterProfile, nbytes: float, crosses_nodes: bool) -> float:
    """One point-to-point message between neighbouring pipeline stages."""
    if nbytes <= 0:
        return 0.0
    fit = None if crosses_nodes else profile.collectives.get("send_recv", {}).get(2)
    if fit is not None:
        return fit[0] + fit[1] * nbytes
    link = profile.inter_node if crosses_nodes else profile.intra_node
    return link.latency + nbytes / link.bandwidth
