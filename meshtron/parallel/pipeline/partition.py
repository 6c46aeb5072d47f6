"""Which transformer layers each pipeline stage (and each of its virtual chunks) holds.

With ``pp`` stages and ``vpp`` chunks per stage there are ``pp * vpp`` virtual stages; chunk
``c`` of stage ``s`` is virtual stage ``c * pp + s`` (Megatron's interleaving) or, in the V
placement of the zb-v schedule (two chunks), ``s`` and ``2 * pp - 1 - s``: stage 0 then holds
the first and the last virtual stage. Virtual stages take consecutive runs of layers in model
order. Virtual stage 0 also holds the embedding, the last one the final norm, the output layer
and the loss.

The balanced split minimises the most expensive virtual stage, where a layer costs its forward
FLOPs per token and the output layer + loss is charged its own FLOPs in the same unit (the
embedding lookup does no matrix multiply and is free; the plan passes
:func:`meshtron.models.flops.layer_and_head_cost`). ``parallel.pp_layers`` overrides it.

A stage boundary may also fall inside a layer, between its attention and its MLP (a count of
``4.5`` layers; with ``parallel.pp_half_layers`` the balanced split considers such cuts too):
one stage then holds the layer's attention half, the next its MLP half, and the hidden state
between them is what crosses. With few layers per stage and a large output layer that is the
difference between a stage one layer short and a balanced one (benchmarks/pipeline_bound.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache

from meshtron.config import ModelConfig
from meshtron.errors import MeshtronError
from meshtron.parallel.pipeline.v_order import fitted_order, v_place, v_virtual
from meshtron.parallel.pipeline.v_split import v_balanced_splits


def balanced_split(pieces: list[float], stages: int, head_cost: float,
                   first_cost: float = 0.0, even_after: int | None = None) -> list[int]:
    """Consecutive runs of ``pieces`` (their number per stage, each at least one) minimising
    the costliest stage, the last also charged ``head_cost`` and the first ``first_cost``;
    ties go to the split that puts more pieces early. ``even_after``: the first that many
    stages together take an even number of pieces (a whole layer where pieces are halves)."""
    assert len(pieces) >= stages, "checked by check_layer_split"
    ends = [0.0]
    for cost in pieces:
        ends.append(ends[-1] + cost)

    @cache
    def best(first: int, stages_left: int) -> tuple[float, tuple[int, ...]]:
        """Cheapest split of pieces first.. into ``stages_left`` stages."""
        extra = first_cost if first == 0 else 0.0
        if stages_left == 1:
            return ends[-1] - ends[first] + head_cost + extra, (len(pieces) - first,)
        options = []
        for count in range(len(pieces) - first - stages_left + 1, 0, -1):
            if stages - stages_left + 1 == even_after and (first + count) % 2:
                continue
            rest_cost, rest = best(first + count, stages_left - 1)
            own = ends[first + count] - ends[first] + extra
            options.append((max(own, rest_cost), (count, *rest)))
        return min(options, key=lambda option: option[0], default=(float("inf"), ()))

    return list(best(0, stages)[1])


def balanced_counts(num_layers: int, stages: int, layer_cost: float,
                    head_cost: float, first_cost: float = 0.0,
                    attention_cost: float | None = None) -> list[float]:
    """Layers per virtual stage minimising the costliest stage (see :func:`balanced_split`).
    ``first_cost``: what the first stage runs besides its layers (the model's input
    encoders). ``attention_cost`` (of ``layer_cost``): given, a stage may also end after a
    layer's attention half, and counts come in halves."""
    counts = balanced_split(_pieces(num_layers, layer_cost, attention_cost), stages, head_cost,
                            first_cost)
    return counts if attention_cost is None else [in_layers(n) for n in counts]


def _pieces(num_layers: int, layer_cost: float, attention_cost: float | None) -> list[float]:
    """The costs of the units a split moves: layers, or their halves with ``attention_cost``."""
    if attention_cost is None:
        return [layer_cost] * num_layers
    return [attention_cost, layer_cost - attention_cost] * num_layers


def v_counts(num_layers: int, pp: int, layer_cost: float, head_cost: float,
             first_cost: float = 0.0, attention_cost: float | None = None) -> list[float]:
    """zb-v's layers per virtual stage (2 pp, in model order): of the split that balances the
    virtual stages and those that balance the stages (:func:`v_balanced_splits`, better when
    the head outweighs an average virtual stage), the one whose order
    (:func:`.v_order.fitted_order`, over :data:`V_TRIAL_ROUNDS` pp micro-batches) ends
    first. Splits with the same busiest stage differ there: a heavy last chunk (the head)
    behind a light first one leaves every stage waiting once a round. With
    ``attention_cost`` in half layers, never cutting a layer at the turn of the V."""
    chosen = _timed_v_split(num_layers, pp, layer_cost, head_cost, first_cost, attention_cost)
    return [in_layers(n) if attention_cost is not None else n for n in chosen]


@lru_cache(maxsize=64)  # a plan check per searched layout asks again with the same model
def _timed_v_split(num_layers: int, pp: int, layer_cost: float, head_cost: float,
                   first_cost: float, attention_cost: float | None) -> tuple[int, ...]:
    """:func:`v_counts` in pieces (layers, or halves with ``attention_cost``)."""
    halves = attention_cost is not None
    pieces = _pieces(num_layers, layer_cost, attention_cost)

    def makespan(counts: list[int]) -> float:
        bounds = [sum(counts[:k]) for k in range(2 * pp + 1)]
        costs = [sum(pieces[a:b]) for a, b in zip(bounds, bounds[1:])]
        costs[0] += first_cost
        costs[-1] += head_cost
        return fitted_order(pp, V_TRIAL_ROUNDS * pp, costs)[1]

    by_stage = v_balanced_splits(pieces, pp, head_cost, first_cost, even_turn=halves)
    step = max(1, -(-len(by_stage) // V_TRIALS))
    options = [balanced_split(pieces, 2 * pp, head_cost, first_cost, pp if halves else None),
               *by_stage[::step]]
    timed = [makespan(counts) for counts in options]
    return tuple(options[timed.index(min(timed))])


V_TRIAL_ROUNDS = 4
"""The micro-batches (times pp) over which :func:`v_counts` times each split's order: past the
start-up, as the steady state of a real step."""
V_TRIALS = 4
"""At most this many of the stage-balanced splits are timed (spread over the ways found)."""


def in_layers(halves: int) -> float:
    """A number of half layers as layers: an int when whole (``4``), else ``4.5``."""
    return halves // 2 if halves % 2 == 0 else halves / 2


def virtual_stage_of(pp: int, stage: int, chunk: int, vshape: bool = False) -> int:
    """The virtual stage chunk ``chunk`` of ``stage`` runs: looped (Megatron) or in a V."""
    if vshape:
        return v_virtual(pp, stage, chunk)
    return chunk * pp + stage


def placement_of(pp: int, virtual_stage: int, vshape: bool = False) -> tuple[int, int]:
    """The (stage, chunk) that runs ``virtual_stage`` (inverse of :func:`virtual_stage_of`)."""
    if vshape:
        return v_place(pp, virtual_stage)
    return virtual_stage % pp, virtual_stage // pp


ATTENTION_HALF, MLP_HALF = "attention", "mlp"
"""The halves of a layer that a stage boundary may separate."""


@dataclass(frozen=True)
class StageLayers:
    """The part of the model one pipeline stage holds: its chunks of global layer indices, in
    the order its forward passes run them, whether it holds the embedding and the head, and
    the layers it holds only one half of (``(layer, ATTENTION_HALF or MLP_HALF)``)."""

    chunks: tuple[tuple[int, ...], ...]
    embedding: bool
    head: bool
    halves: tuple[tuple[int, str], ...] = ()

    def parts(self, layer: int) -> tuple[str, ...]:
        """The halves of ``layer`` this stage holds: both, or the one it shares."""
        return next(((half,) for i, half in self.halves if i == layer), (ATTENTION_HALF, MLP_HALF))


@dataclass(frozen=True)
class PipelinePartition:
    """The layer split of a ``pp`` x ``vpp`` pipeline (``counts`` of layers per virtual stage,
    in halves where a boundary cuts a layer), its chunks placed in a V with ``vshape``."""

    pp: int
    vpp: int
    counts: tuple[float, ...]
    vshape: bool = False

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.vpp

    def _half_bounds(self, virtual_stage: int) -> tuple[int, int]:
        """The first and one-past-last half layer of ``virtual_stage`` (half 2i is layer i's
        attention, 2i + 1 its MLP)."""
        start = round(2 * sum(self.counts[:virtual_stage]))
        return start, start + round(2 * self.counts[virtual_stage])

    def layers_of(self, virtual_stage: int) -> list[int]:
        """The layers ``virtual_stage`` holds all or half of."""
        start, end = self._half_bounds(virtual_stage)
        return list(range(start // 2, (end + 1) // 2))

    def halves_of(self, virtual_stage: int) -> list[tuple[int, str]]:
        """The layers ``virtual_stage`` holds only one half of, with that half."""
        start, end = self._half_bounds(virtual_stage)
        return [*([(start // 2, MLP_HALF)] if start % 2 else []),
                *([(end // 2, ATTENTION_HALF)] if end % 2 else [])]

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return virtual_stage_of(self.pp, stage, chunk, self.vshape)

    def chunks_of(self, stage: int) -> list[list[int]]:
        """Global layer indices of each chunk of ``stage``, chunk 0 first."""
        return [self.layers_of(self.virtual_stage(stage, c)) for c in range(self.vpp)]

    def holds_embedding(self, stage: int) -> bool:
        return stage == 0

    def holds_head(self, stage: int) -> bool:
        return placement_of(self.pp, self.virtual_stages - 1, self.vshape)[0] == stage

    def stage_layers(self, stage: int) -> StageLayers:
        """What the model of pipeline stage ``stage`` holds."""
        halves = [h for c in range(self.vpp) for h in self.halves_of(self.virtual_stage(stage, c))]
        return StageLayers(tuple(tuple(c) for c in self.chunks_of(stage)),
                           self.holds_embedding(stage), self.holds_head(stage), tuple(halves))

    def virtual_stage_costs(self, layer: float, head: float, attention: float | None = None,
                            first: float = 0.0) -> list[float]:
        """Each virtual stage's forward cost in the units of ``layer`` (a layer), ``head``
        (the output layer and loss, on the last), ``first`` (what the first runs before its
        layers) and ``attention`` (a layer's attention half; None: half a layer)."""
        half = {ATTENTION_HALF: layer / 2 if attention is None else attention}
        half[MLP_HALF] = layer - half[ATTENTION_HALF]
        costs = []
        for k in range(self.virtual_stages):
            cut = self.halves_of(k)
            costs.append((len(self.layers_of(k)) - len(cut)) * layer
                         + sum(half[part] for _, part in cut))
        costs[0] += first
        costs[-1] += head
        return costs

    def describe(self) -> str:
        """Layers per stage, e.g. ``3 | 1`` (``2+2 | 2+2`` with chunks, ``4.5 | 3.5`` with a
        layer cut in halves)."""
        return " | ".join("+".join(f"{self.counts[self.virtual_stage(s, c)]:g}"
                                   for c in range(self.vpp)) for s in range(self.pp))


def check_layer_split(cfg: ModelConfig, pp: int, vpp: int,
                      explicit: list[float] | None, vshape: bool = False) -> None:
    """Reject a split that cannot be made, saying what is needed."""
    stages = pp * vpp
    if explicit:
        if len(explicit) != stages:
            raise MeshtronError(
                f"parallel.pp_layers has {len(explicit)} entries, the pipeline has pp*vpp = "
                f"{pp}*{vpp} = {stages} virtual stages"
            )
        if min(explicit) < 0.5 or any(2 * n != round(2 * n) for n in explicit) \
                or sum(explicit) != cfg.num_layers:
            raise MeshtronError(
                f"parallel.pp_layers={explicit} must give every virtual stage at least half a "
                f"layer, in whole or half layers, and sum to model.num_layers={cfg.num_layers}"
            )
        if pp == 1 and any(n != int(n) for n in explicit):
            raise MeshtronError(
                f"parallel.pp_layers={explicit} cuts a layer in halves, which must sit on two "
                "pipeline stages: give whole layers or set parallel.pp >= 2"
            )
        if vshape and sum(explicit[:pp]) != int(sum(explicit[:pp])):
            raise MeshtronError(
                f"parallel.pp_layers={explicit} cuts a layer at the turn of zb-v's V, where "
                f"virtual stages {pp - 1} and {pp} share stage {pp - 1}: the first {pp} entries "
                "must sum to whole layers"
            )
        return
    if cfg.num_layers < stages:
        raise MeshtronError(
            f"a pipeline of pp*vpp = {pp}*{vpp} = {stages} virtual stages needs at least "
            f"{stages} layers, model.num_layers is {cfg.num_layers}; lower parallel.pp or "
            "parallel.vpp"
        )
    if vpp > 1 and not vshape and cfg.num_layers % stages:
        raise MeshtronError(
            f"parallel.vpp={vpp} splits each stage's layers into {vpp} equal chunks: "
            f"model.num_layers={cfg.num_layers} must be divisible by pp*vpp = {stages} (or "
            "give parallel.pp_layers)"
        )


def partition_layers(cfg: ModelConfig, pp: int, vpp: int, costs: tuple[float, float],
                     explicit: list[float] | None = None, first_cost: float = 0.0,
                     attention_cost: float | None = None,
                     vshape: bool = False) -> PipelinePartition:
    """The split given by ``explicit`` (``parallel.pp_layers``) or the one balanced for
    ``costs``: the forward FLOPs per token of one layer and of the output layer, and
    ``first_cost`` of what the first stage runs before its layers; ``attention_cost`` (a
    layer's attention half, with ``parallel.pp_half_layers`` and pp >= 2) lets it cut layers
    in halves. ``vshape``: chunks placed in a V (zb-v; :func:`v_counts`)."""
    check_layer_split(cfg, pp, vpp, explicit, vshape)
    stages = pp * vpp
    if explicit:
        return PipelinePartition(pp, vpp, tuple(explicit), vshape)
    if vpp > 1 and not vshape:  # interleaving assumes equal chunks, as in Megatron
        return PipelinePartition(pp, vpp, (cfg.num_layers // stages,) * stages)
    layer, head = costs
    if vshape:
        counts = v_counts(cfg.num_layers, pp, layer, head, first_cost, attention_cost)
    else:
        counts = balanced_counts(cfg.num_layers, stages, layer, head, first_cost,
                                 attention_cost if pp > 1 else None)
    return PipelinePartition(pp, vpp, tuple(counts), vshape)
