"""The tensor-, context- and expert-parallel communication of one micro-batch, per layer and
at the model's two ends, priced with :mod:`meshtron.tuning.comms`."""

from __future__ import annotations

from meshtron.tuning.candidate import Candidate
from meshtron.tuning.comms import collective_seconds, layout_groups, send_seconds
from meshtron.tuning.problem import Problem


def layer_communication(pr: Problem, layer: int, c: Candidate, core_seconds: float,
                        overlaps: bool) -> tuple[float, float]:
    """(forward, backward) seconds of the layer's tp, cp and ep communication; the cp ring
    hides behind the attention core where communication ``overlaps`` compute."""
    cfg = pr.model
    groups = layout_groups(c, pr.profile.gpus_per_node)
    tokens = c.micro_batch * pr.seq_len / c.cp
    activation = tokens * cfg.hidden_size * pr.element_size
    # two tp regions per layer (attention, MLP), each entered and left once: under sp by
    # an all-gather and a reduce-scatter, else left by an all-reduce (in backward the
    # entry's all-reduce, or the same pair swapped)
    if c.sp and c.tp > 1:
        tp_one = 2 * (collective_seconds(pr.profile, "all_gather", groups.tp, activation)
                      + collective_seconds(pr.profile, "reduce_scatter", groups.tp,
                                           activation))
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


def edge_communication(pr: Problem, c: Candidate
                       ) -> tuple[tuple[float, float], tuple[float, float]]:
    """(forward, backward) tp seconds of one micro-batch at the embedding, and at each
    output layer with its loss. The vocabulary-parallel embedding sums its rows over tp (a
    reduce-scatter under sp, whose backward gathers; an all-reduce without, whose backward
    is the identity). The output layer's input is gathered under sp (reduce-scattered in
    backward); without sp its input gradient is all-reduced. The loss all-reduces the max
    and then the exponential sum with the target logit, fp32 per token."""
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
        return (scatter, gather), (gather + loss, scatter)
    reduce = seconds("all_reduce", activation)
    return (reduce, 0.0), (loss, reduce)
