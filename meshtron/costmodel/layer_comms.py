"""The tensor-, context- and expert-parallel communication of one micro-batch, per layer and
at the model's two ends, priced with :mod:`meshtron.costmodel.comms`.

Under ``parallel.tp_comm_overlap`` (:mod:`meshtron.parallel.tensor.overlap`) a region's
all-gather is cut into ``k`` pieces, piece j's product running while piece j+1 travels, and
likewise the reduce-scatter after a row-parallel product: what stays exposed is the
pipeline's fill and drain, ``c + (k-1) max(c, g) + g - G`` for pieces of ``c`` seconds of
communication and ``g = G/k`` of the product. Where communication cannot run beside compute
(CPU ranks) nothing hides, and the k smaller collectives cost k latencies.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.comms import PricedGroup, collective_seconds, layout_groups, send_seconds
from meshtron.costmodel.problem import Problem
from meshtron.models.arch import architecture_of


def overlapped_seconds(pr: Problem, kind: str, group: PricedGroup, nbytes: float, gemm: float,
                       overlaps: bool) -> float:
    """Exposed seconds of a ``kind`` collective of ``nbytes`` cut into ``pr.tp_comm_chunks``
    pieces beside a product of ``gemm`` seconds (the formula of the module docstring)."""
    k = pr.tp_comm_chunks
    piece = collective_seconds(pr.profile, kind, group, nbytes / k)
    if not overlaps:
        return k * piece
    return piece + (k - 1) * max(piece, gemm / k) + gemm / k - gemm


def _sp_region(pr: Problem, group: PricedGroup, activation: float, entry_gemm: float,
               exit_gemm: float, overlapped: bool, overlaps: bool) -> float:
    """One region's all-gather in and reduce-scatter out (forward; backward swaps them over
    the same products), whole or overlapped with the products beside them."""
    if not overlapped:
        return (collective_seconds(pr.profile, "all_gather", group, activation)
                + collective_seconds(pr.profile, "reduce_scatter", group, activation))
    return (overlapped_seconds(pr, "all_gather", group, activation, entry_gemm, overlaps)
            + overlapped_seconds(pr, "reduce_scatter", group, activation, exit_gemm,
                                 overlaps))


def layer_communication(pr: Problem, layer: int, c: Candidate, core_seconds: float,
                        overlaps: bool, gemms: Sequence[float] = ()) -> tuple[float, float]:
    """(forward, backward) seconds of the layer's tp, cp and ep communication; the cp ring
    hides behind the attention core where communication ``overlaps`` compute. ``gemms``: the
    layer's forward GEMM seconds in :func:`~meshtron.costmodel.workload.layer_work`'s order
    (q/kv, output projection, MLP, ...), which overlapped tp collectives hide behind."""
    cfg = pr.model
    groups = layout_groups(c, pr.profile.gpus_per_node)
    tokens = c.micro_batch * pr.seq_len / c.cp
    activation = tokens * cfg.hidden_size * pr.element_size
    # two tp regions per layer (attention, MLP), each entered and left once: under sp by
    # an all-gather and a reduce-scatter, else left by an all-reduce (in backward the
    # entry's all-reduce, or the same pair swapped)
    if c.sp and c.tp > 1:
        chunked = pr.tp_comm_chunks > 0 and len(gemms) >= 3
        moe = cfg.is_moe_layer(layer)
        entry = 2 / 3 if architecture_of(cfg).gated_mlp else 1 / 2  # gate_up's share
        mlp = gemms[2] if chunked and not moe else 0.0
        tp_one = _sp_region(pr, groups.tp, activation, *(gemms[:2] if chunked else (0, 0)),
                            chunked and not cfg.latent_attention, overlaps) \
            + _sp_region(pr, groups.tp, activation, entry * mlp, (1 - entry) * mlp,
                         chunked and not moe, overlaps)
    else:
        tp_one = 2 * collective_seconds(pr.profile, "all_reduce", groups.tp, activation)
    forward = backward = tp_one
    if c.cp > 1:
        kv = tokens * 2 * cfg.num_kv_heads * cfg.head_size / min(c.tp, cfg.num_kv_heads) \
            * pr.element_size
        if pr.cp_comm == "ring":
            ring = (c.cp - 1) * send_seconds(pr.profile, kv, groups.cp.crosses_nodes)
            hidden = core_seconds if overlaps else 0.0
            forward += max(0.0, ring - hidden)
            backward += max(0.0, 2 * ring - 2.5 * hidden)
        elif pr.cp_comm == "all_gather":
            forward += collective_seconds(pr.profile, "all_gather", groups.cp, kv * c.cp)
            backward += collective_seconds(pr.profile, "reduce_scatter", groups.cp,
                                           kv * c.cp)
        else:  # all_to_all: q, k, v and the output trade the sequence split for heads
            qkvo = tokens * (2 * cfg.num_heads * cfg.head_size / c.tp) * pr.element_size \
                + kv
            forward += collective_seconds(pr.profile, "all_to_all", groups.cp, qkvo)
            backward += collective_seconds(pr.profile, "all_to_all", groups.cp, qkvo)
    if cfg.is_moe_layer(layer) and c.ep > 1:
        routed = tokens * cfg.moe.top_k / (c.tp if c.etp == 1 else 1)
        a2a = 2 * collective_seconds(pr.profile, "all_to_all", groups.ep,
                                     routed * cfg.hidden_size * pr.element_size)
        forward += a2a
        backward += a2a
    return forward, backward


def edge_communication(pr: Problem, c: Candidate, head_gemm: float = 0.0,
                       overlaps: bool = False
                       ) -> tuple[tuple[float, float], tuple[float, float]]:
    """(forward, backward) tp seconds of one micro-batch at the embedding, and at each
    output layer with its loss. The vocabulary-parallel embedding sums its rows over tp (a
    reduce-scatter under sp, whose backward gathers; an all-reduce without, whose backward
    is the identity). The output layer's input is gathered under sp (reduce-scattered in
    backward), overlapped with its ``head_gemm`` seconds of product under tp_comm_overlap;
    without sp its input gradient is all-reduced. The loss all-reduces the max and then the
    exponential sum with the target logit, fp32 per token."""
    if c.tp == 1:
        return (0.0, 0.0), (0.0, 0.0)
    group = layout_groups(c, pr.profile.gpus_per_node).tp
    tokens = c.micro_batch * pr.seq_len / c.cp
    activation = tokens * pr.model.hidden_size * pr.element_size

    def seconds(kind: str, nbytes: float) -> float:
        return collective_seconds(pr.profile, kind, group, nbytes)

    loss = seconds("all_reduce", 4 * tokens) + seconds("all_reduce", 8 * tokens)
    if c.sp:
        gather, scatter = seconds("all_gather", activation), \
            seconds("reduce_scatter", activation)
        if pr.tp_comm_chunks:
            head = (overlapped_seconds(pr, "all_gather", group, activation, head_gemm,
                                       overlaps),
                    overlapped_seconds(pr, "reduce_scatter", group, activation, head_gemm,
                                       overlaps))
            return (scatter, gather), (head[0] + loss, head[1])
        return (scatter, gather), (gather + loss, scatter)
    reduce = seconds("all_reduce", activation)
    return (reduce, 0.0), (loss, reduce)
