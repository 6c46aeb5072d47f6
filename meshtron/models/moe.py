"""Mixture of experts: a router, routed experts spread over the ep group, shared experts.

One MoE layer replaces the MLP of a block (``model.moe.*`` says which blocks)::

    router (fp32) -> top-k experts and weights per token
      -> [capacity: drop the lowest-weighted copies beyond each expert's capacity]
      -> tokens sorted by expert -> all-to-all to the experts' ep ranks
      -> one grouped matmul per projection over the local experts
      -> all-to-all back -> weighted sum per token (+ shared experts)

Tensor parallelism splits every expert like the dense MLP by default (expert tensor parallel =
tp): the router runs on the block input and its top-k weights enter the tp region (all-reduce of
their gradient, or the sequence-parallel gather), each tp rank computes its slice of every
chosen expert and the weighted partial outputs leave the region together. With
``parallel.etp=1`` experts stay whole: each tp rank routes its own part of the sequence (its SP
chunk, or a split of the replicated stream gathered back afterwards), and the ep groups fold
over tp as well, so tp ranks are expert-parallel peers.

Auxiliary losses (load balancing, z-loss) never reach the logits: their gradient is injected
into the backward pass at the layer's output (scaled like the language-model loss, see
``loss_weight``), so they work unchanged inside pipeline schedules. Expert parameters are
summed over the expert-data-parallel group only (their layout's ``data_parallel``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.autograd import attach_loss, in_backward
from meshtron.config import ModelConfig, MoEConfig
from meshtron.parallel.experts.dispatch import Dispatch
from meshtron.parallel.experts.grouped import grouped_low_rank, grouped_matmul
from meshtron.parallel.mesh.groups import Group, ParallelMesh
from meshtron.parallel.mesh.params import SliceSpec
from meshtron.parallel.tensor.collectives import all_gather, all_reduce, gather_to_tp, split_to_tp
from meshtron.parallel.tensor.layers import TPRegion, sliced
from meshtron.parallel.tensor.lora import LoraAdapter, base_product_weight
from meshtron.precision.mx import MXExperts
from meshtron.precision.policy import at_least_fp32

TIE_GRID = 2.0**20
"""Routing weights that agree to 2^-20 are tied for capacity: the earlier token keeps its slot."""


@dataclass
class RoutingStats:
    """Sums over one optimizer step's micro-batches on this rank (one MoE layer)."""

    num_experts: int
    aux: float = 0.0
    """Sum over balancing units (micro-batches or sequences) of tokens x balance loss."""
    z: float = 0.0
    """Sum over tokens of logsumexp(logits)^2."""
    dropped: int = 0
    routed: int = 0
    load: torch.Tensor = field(init=False)
    """Token copies routed to each expert (before capacity drops)."""

    def __post_init__(self) -> None:
        self.load = torch.zeros(self.num_experts, dtype=torch.float64)

    def as_tensor(self) -> torch.Tensor:
        head = torch.tensor([self.aux, self.z, self.dropped, self.routed], dtype=torch.float64)
        return torch.cat([head, self.load])

    def reset(self) -> None:
        self.aux = self.z = 0.0
        self.dropped = self.routed = 0
        self.load.zero_()


class Router(nn.Module):
    """Scores every expert per token (in fp32, fp64 in fp64 runs) and picks each token's
    top-k."""

    def __init__(self, cfg: ModelConfig, region: TPRegion, tokens_split: bool):
        """``tokens_split``: each tp rank routes only its share of the tokens (sequence
        parallelism, or whole experts), so the weight's gradient is summed over tp."""
        super().__init__()
        moe = cfg.moe
        self.moe = moe
        self.weight = sliced(nn.Parameter(torch.empty(moe.num_experts, cfg.hidden_size)),
                             (moe.num_experts, cfg.hidden_size), None, region.size,
                             region.group if tokens_split else None)
        self.expert_bias = nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False)
        """Aux-loss-free balancing: added to the scores for selection only; a training state
        (checkpointed like a weight) moved by :meth:`update_bias`, never by the optimizer."""
        sliced(self.expert_bias, (moe.num_experts,), None, region.size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [n, h] -> (logits [n, E], probabilities [n, E], experts [n, k], weights [n, k])."""
        moe = self.moe
        dtype = at_least_fp32(x.dtype)
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        scores = logits.softmax(-1) if moe.score == "softmax" else logits.sigmoid()
        select = scores.detach() + self.expert_bias
        if moe.groups > 1:
            select = self._limit_groups(select)
        experts = select.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if moe.normalize_topk:  # a lone expert's weight becomes exactly 1 (Mixtral)
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        if moe.route_scale != 1.0:
            weights = weights * moe.route_scale
        probs = scores if moe.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return logits, probs, experts, weights

    def _limit_groups(self, select: torch.Tensor) -> torch.Tensor:
        """Keep only each token's ``topk_groups`` best groups, a group scored by the sum of its
        two best experts (DeepSeek-V3)."""
        moe = self.moe
        grouped = select.view(len(select), moe.groups, -1)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        chosen = best.topk(moe.topk_groups, dim=-1).indices
        allowed = torch.zeros_like(best, dtype=torch.bool).scatter_(1, chosen, True)
        return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view_as(select)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Raise the bias of experts below the mean load, lower those above (sign update)."""
        load = load.to(self.expert_bias)
        self.expert_bias.add_(torch.sign(load.mean() - load), alpha=self.moe.bias_update)


class ExpertWeight(nn.Module):
    """Holds one weight, so that expert parameters are named like the rest
    (``experts.3.gate_up.weight``), and its LoRA adapter where ``model.lora.targets`` has
    experts (``experts.3.gate_up.lora.a``, models/adapters.py)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight
        self.lora: LoraAdapter | None = None


class Expert(nn.Module):
    """One expert's FFN weights (no biases; SwiGLU's fused [gate | up] when ``gated``), split
    over tp like the dense MLP unless ``whole``; summed over ``data_parallel`` (the expert-data-
    parallel group) rather than dp x cp."""

    def __init__(self, cfg: ModelConfig, region: TPRegion, data_parallel: Group, whole: bool,
                 gated: bool):
        super().__init__()
        tp, rank = (1, 0) if whole else (region.size, region.group.rank)
        ffn, h = cfg.moe.expert_ffn_size, cfg.hidden_size
        self.gated = gated
        up_rows = 2 * ffn if gated else ffn
        up = sliced(nn.Parameter(torch.empty(up_rows // tp, h)), (up_rows, h),
                    SliceSpec(0, rank, tp, parts=2 if gated else 1) if tp > 1 else None,
                    data_parallel=data_parallel)
        down = sliced(nn.Parameter(torch.empty(h, ffn // tp)), (h, ffn),
                      SliceSpec(1, rank, tp) if tp > 1 else None, data_parallel=data_parallel)
        if gated:
            self.gate_up = ExpertWeight(up)
        else:
            self.up = ExpertWeight(up)
        self.down = ExpertWeight(down)

    @property
    def up_holder(self) -> ExpertWeight:
        return self.gate_up if self.gated else self.up


@dataclass
class RowRouting:
    """Which token copies a rank sends to the experts, and in what order."""

    routed: torch.Tensor
    """Copies routed to each expert [E] (before the capacity)."""
    order: torch.Tensor
    """The kept copies (flat index token * k + slot), sorted by expert (stable: by token, or
    with a capacity by descending weight)."""
    rows_per_expert: torch.Tensor
    """Rows each expert gets in the send buffer [E]."""
    rows: torch.Tensor | None
    """With padding to capacity: each kept copy's row in the padded buffer."""

    @classmethod
    def build(cls, experts: torch.Tensor, weights: torch.Tensor | None,
              moe: MoEConfig) -> RowRouting:
        """The routing of token copies ``experts`` [n, k] with routing ``weights`` (needed only
        with a capacity)."""
        num_experts, flat = moe.num_experts, experts.reshape(-1)
        routed = torch.bincount(flat, minlength=num_experts)
        if moe.capacity_factor == 0:
            return cls(routed, torch.argsort(flat, stable=True), routed, None)
        capacity = math.ceil(moe.capacity_factor * len(experts) * moe.top_k / num_experts)
        # weights on a 2^-20 grid: copies of equal weight in exact arithmetic (a repeated
        # context) differ by the GEMM's last bit, which depends on the row's place in the
        # batch and on the CPU's kernels; so such near-ties go by token order instead
        grid = torch.round(weights.reshape(-1).double() * TIE_GRID) / TIE_GRID
        by_weight = torch.argsort(-grid, stable=True)
        order = by_weight[torch.argsort(flat[by_weight], stable=True)]
        sorted_experts = flat[order]
        position = torch.arange(len(order), device=order.device) - (
            torch.cumsum(routed, 0) - routed)[sorted_experts]
        keep = position < capacity  # the lowest-weighted copies beyond capacity drop
        order, sorted_experts, position = order[keep], sorted_experts[keep], position[keep]
        if not moe.pad_to_capacity:
            return cls(routed, order, routed.clamp(max=capacity), None)
        return cls(routed, order, torch.full_like(routed, capacity),
                   capacity * sorted_experts + position)

    def share(self, experts: torch.Tensor, batch: int, index: int, count: int) -> RowRouting:
        """The part of this routing (made for ``experts`` [batch * seq, k] of whole sequences)
        that falls in sequence chunk ``index`` of ``count``, numbered as that chunk's tokens."""
        k = experts.shape[-1]
        seq = len(experts) // batch
        chunk = seq // count
        token, position = self.order // k, (self.order // k) % seq
        mine = position // chunk == index
        order, token, position = self.order[mine], token[mine], position[mine]
        local_copy = ((token // seq) * chunk + position - index * chunk) * k + order % k
        sorted_experts = experts.reshape(-1)[order]
        rows_per_expert = torch.bincount(sorted_experts, minlength=len(self.routed))
        rows = None
        if self.rows is not None:  # padded: each chunk pads its copies to the capacity
            capacity = self.rows_per_expert[:1]
            start = torch.cumsum(rows_per_expert, 0) - rows_per_expert
            in_expert = torch.arange(len(order), device=order.device) - start[sorted_experts]
            rows = capacity * sorted_experts + in_expert
            rows_per_expert = self.rows_per_expert
        return RowRouting(self.routed, local_copy, rows_per_expert, rows)


def _low_precision_product(mx: MXExperts, grouped: Callable, sources: torch.Tensor,
                           rows: torch.Tensor, weights: list[torch.Tensor],
                           counts: torch.Tensor) -> torch.Tensor:
    """``grouped(rows, weights, counts)`` with its operands (and its backward's) in MXFP8;
    ``sources``: each local expert's rows by the ep rank they came from."""
    return mx.matmul(rows, torch.stack(weights), counts, grouped, sources)


class MoE(nn.Module):
    """Drop-in replacement for the block's MLP: [b, s, h] -> [b, s, h] (s local under SP)."""

    def __init__(self, cfg: ModelConfig, region: TPRegion, mesh: ParallelMesh,
                 shared: nn.Module | None, gated: bool, loss_weight: Callable[[], float],
                 low_precision: MXExperts | None = None):
        """``loss_weight`` gives, at each forward, the gradient of the auxiliary losses per
        unit of loss: the weight the language-model loss sum gets (loss scale / global
        tokens). ``low_precision``: the experts' grouped products in MXFP8 (None: in the
        parameters' dtype)."""
        super().__init__()
        moe = cfg.moe
        self.moe = moe
        self.region = region
        self.ep = mesh.ep
        self.cp = mesh.cp
        self.whole_experts = mesh.layout.whole_experts
        """Expert tensor parallel 1: every expert whole; each tp rank routes its share."""
        self.tokens_split = region.sequence_parallel or self.whole_experts
        """Each tp rank routes only its part of the sequence."""
        self.router = Router(cfg, region, self.tokens_split)
        local = moe.num_experts // mesh.ep.size
        first = mesh.ep.rank * local
        self.experts = nn.ModuleDict({
            str(first + j): Expert(cfg, region, mesh.edp, self.whole_experts, gated)
            for j in range(local)})
        self.shared = shared
        self.gated = gated
        self.dropout = cfg.dropout
        self.loss_weight = loss_weight
        self.stats = RoutingStats(moe.num_experts)
        self.low_precision = low_precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, k = self.region.group, self.moe.top_k
        mine = x  # the tokens this rank routes
        if self.tokens_split and not self.region.sequence_parallel:
            mine = split_to_tp(x, group)
        b, s_mine, h = mine.shape
        logits, probs, experts, weights = self.router(mine.reshape(-1, h))
        chosen = experts.view(b, s_mine, k)  # every token's experts, on every tp rank
        if self.tokens_split:
            chosen = all_gather(chosen, group, dim=1)
        chosen = chosen.reshape(-1, k)
        if self.whole_experts:
            out = self._whole_experts(mine, chosen, weights)
        else:  # expert tensor parallel = tp: the whole micro-batch, each rank a slice of experts
            weights = self.region.enter(weights.view(b, s_mine, k)).reshape(-1, k)
            tokens = self.region.enter(x).reshape(-1, h)
            routed = self._routed(tokens, self._route(chosen, weights.detach()), weights)
            out = self.region.exit(routed.view(b, -1, h))
        if self.shared is not None:
            out = out + self.shared(x)
        out = F.dropout(out, self.dropout, self.training)
        if self.training and torch.is_grad_enabled():
            if self.cp.pg is not None:  # balance counts cover the whole sequence
                chosen = all_gather(chosen.view(b, -1, k), self.cp, dim=1).reshape(-1, k)
            out = self._attach_aux_losses(out, logits, probs, chosen, b)
        return out

    def _whole_experts(self, mine: torch.Tensor, chosen: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
        """Expert tensor parallel 1: this rank's tokens ``mine`` [b, s/tp, h] through whole
        experts, routed over the whole micro-batch (``chosen``), output gathered back over tp
        unless the stream is sequence-parallel."""
        group, (b, s_mine, h) = self.region.group, mine.shape
        every_weight = None
        if self.moe.capacity_factor:  # capacity is decided over the whole micro-batch
            every_weight = all_gather(weights.detach().view(b, s_mine, -1), group, dim=1)
        routing = self._route(chosen, every_weight).share(chosen, b, group.rank, group.size)
        out = self._routed(mine.reshape(-1, h), routing, weights).view(b, s_mine, h)
        return out if self.region.sequence_parallel else gather_to_tp(out, group)

    # ------------------------------------------------------------------ dispatch and experts

    def _route(self, chosen: torch.Tensor, weights: torch.Tensor | None) -> RowRouting:
        """The row routing of the whole micro-batch; its routing statistics are recorded."""
        routing = RowRouting.build(chosen, weights, self.moe)
        if self.training and not in_backward():
            self.stats.load += routing.routed.double().cpu()
            self.stats.routed += chosen.numel()
            self.stats.dropped += chosen.numel() - len(routing.order)
        return routing

    def _routed(self, tokens: torch.Tensor, routing: RowRouting,
                weights: torch.Tensor) -> torch.Tensor:
        """Σ_k weight_k · expert_k(token) for every row of ``tokens`` (copies per ``routing``)."""
        source = routing.order // self.moe.top_k
        send = tokens[source]
        if routing.rows is not None:
            send = send.new_zeros(int(routing.rows_per_expert.sum()), send.shape[1]).index_copy(
                0, routing.rows, send)
        dispatch = Dispatch(routing.rows_per_expert, self.ep)
        out = dispatch.back(self._experts(dispatch.send(send), dispatch.expert_counts,
                                          dispatch.source_counts))
        if routing.rows is not None:
            out = out[routing.rows]
        out = out * weights.reshape(-1)[routing.order].to(out.dtype).unsqueeze(1)
        return tokens.new_zeros(tokens.shape).index_add(0, source, out)

    def _experts(self, rows: torch.Tensor, counts: torch.Tensor,
                 sources: torch.Tensor) -> torch.Tensor:
        """The local experts' FFNs on rows grouped by expert (counts per local expert, and
        per expert and source rank); each tp rank's partial sum of the down projection."""
        experts = list(self.experts.values())
        grouped = self.moe.compute == "grouped"
        product = partial(grouped_matmul, grouped=grouped)
        if self.low_precision is not None:  # stacked weights, every product in MXFP8
            product = partial(_low_precision_product, self.low_precision, product, sources)
        up = self._adapted(product, rows, [e.up_holder for e in experts], counts)
        if self.gated:
            gate, up = up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.gelu(up, approximate="tanh")
        return self._adapted(product, hidden, [e.down for e in experts], counts)

    def _adapted(self, product: Callable, x: torch.Tensor, holders: list[ExpertWeight],
                 counts: torch.Tensor) -> torch.Tensor:
        """One projection of the local experts, plus each expert's own adapter where they
        have them (in the run's dtype: a frozen base held narrower is cast, and the
        adapters' low-rank products never go through MXFP8)."""
        out = product(x, [base_product_weight(h.weight, x) for h in holders], counts)
        adapters = [h.lora for h in holders if h.lora is not None]
        if not adapters:
            return out
        lora = adapters[0]
        if lora.dropout and self.training:
            x = F.dropout(x, lora.dropout)
        return grouped_low_rank(out, x, [a.a for a in adapters], [a.b for a in adapters],
                                counts, lora.scale, grouped=self.moe.compute == "grouped")

    # ------------------------------------------------------------------ auxiliary losses

    def _attach_aux_losses(self, out: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor,
                           experts: torch.Tensor, batch: int) -> torch.Tensor:
        """Balance loss and z-loss of this rank's tokens, their gradient injected at ``out``.

        Units (a micro-batch, or each sequence) contribute tokens x Switch loss,
        E / (k T) Σ_e f_e P_e with f_e the copies routed to expert e and P_e the sum of its
        probabilities over the unit's T tokens (1 when perfectly balanced). The counts cover the
        whole unit on every tp and cp rank; where tp ranks route their own parts of the sequence
        (SP, whole experts), and always under cp, each sums the probabilities of its own
        positions, so its gradient is exact; the value is summed over tp here and over dp x cp
        with the step's routing statistics.
        """
        moe, num_experts = self.moe, self.moe.num_experts
        per_sequence = moe.aux_loss_scope == "sequence"
        unit_tokens = experts.shape[0] // batch if per_sequence else experts.shape[0]
        units = batch if per_sequence else 1
        picks = experts.view(units, -1)
        counts = torch.zeros(units, num_experts, device=picks.device).scatter_add_(
            1, picks, torch.ones(picks.shape, device=picks.device))
        prob_sums = probs.view(units, -1, num_experts).sum(1)
        aux = (counts * prob_sums).sum() * (num_experts / (moe.top_k * unit_tokens))
        z = torch.logsumexp(logits, dim=-1).square().sum()
        if not in_backward():
            values = torch.stack([aux.detach(), z.detach()]).double()
            if self.tokens_split:
                all_reduce(values, self.region.group)
            self.stats.aux += float(values[0])
            self.stats.z += float(values[1])
        loss = moe.aux_loss * aux + moe.z_loss * z
        weight = self.loss_weight()
        if loss.requires_grad and weight:
            out = attach_loss(out, loss, weight)
        return out


@torch.no_grad()
def step_routing_stats(layers: dict[int, MoE], cfg: ModelConfig, mesh: ParallelMesh,
                       global_tokens: int, update_bias: bool = True,
                       device: torch.device | None = None) -> dict[str, float]:
    """Reduce the step's routing statistics over the mesh, update the aux-loss-free biases
    (unless the step was skipped), reset the counters, and return the metrics (identical on
    every rank).

    ``layers``: this rank's MoE layers by global index; stages of a pipeline hold different
    layers, so the per-layer rows are summed over pp after the data-parallel sum. ``device``:
    where the reductions run (the run's device: NCCL reduces no CPU tensors).
    """
    table = torch.zeros(cfg.num_layers + cfg.mtp_depth, 4 + cfg.moe.num_experts,
                        dtype=torch.float64, device=device)
    for index, layer in layers.items():
        table[index] = layer.stats.as_tensor()
        layer.stats.reset()
    all_reduce(table, mesh.dp_cp)
    for index, layer in layers.items():
        if layer.moe.bias_update and update_bias:
            layer.router.update_bias(table[index, 4:])
    all_reduce(table, mesh.pp)
    moe_rows = table[table[:, 3] > 0]
    if len(moe_rows) == 0:
        return {}
    moe_rows = moe_rows.cpu()
    load = moe_rows[:, 4:]
    imbalance = load.max(1).values / load.mean(1)
    metrics = {
        "moe/aux_loss": float(moe_rows[:, 0].mean() / global_tokens),
        "moe/z_loss": float(moe_rows[:, 1].mean() / global_tokens),
        "moe/dropped_fraction": float(moe_rows[:, 2].sum() / moe_rows[:, 3].sum()),
        "moe/load_max_over_mean": float(imbalance.mean()),
    }
    for index, value in zip(torch.nonzero(table[:, 3] > 0).flatten().tolist(),
                            imbalance.tolist()):
        metrics[f"moe/layer{index}/load_max_over_mean"] = value
    return metrics
