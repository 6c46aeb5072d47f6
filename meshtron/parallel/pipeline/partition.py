"""Which transformer layers each pipeline stage (and each of its virtual chunks) holds.

With ``pp`` stages and ``vpp`` chunks per stage there are ``pp * vpp`` virtual stages; chunk
``c`` of stage ``s`` is virtual stage ``c * pp + s`` (Megatron's interleaving), and virtual
stages take consecutive runs of layers in model order. Virtual stage 0 also holds the
embedding, the last one the final norm, the output layer and the loss.

The balanced split minimises the most expensive virtual stage, where a layer costs its forward
FLOPs per token and the output layer + loss is charged its own FLOPs in the same unit (the
embedding lookup does no matrix multiply and is free; the plan passes
:func:`meshtron.models.flops.layer_and_head_cost`). ``parallel.pp_layers`` overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from meshtron.config import ModelConfig
from meshtron.errors import MeshtronError


def balanced_counts(num_layers: int, stages: int, layer_cost: float,
                    head_cost: float, first_cost: float = 0.0) -> list[int]:
    """Layers per virtual stage (each at least one) minimising the costliest stage; ties go
    to the split that puts more layers early. ``first_cost``: what the first stage runs
    besides its layers (a vision model's image encoder)."""
    assert num_layers >= stages, "checked by check_layer_split"

    @cache
    def best(first: int, stages_left: int) -> tuple[float, tuple[int, ...]]:
        """Cheapest split of layers first.. into ``stages_left`` stages."""
        remaining = num_layers - first
        extra = first_cost if first == 0 else 0.0
        if stages_left == 1:
            return remaining * layer_cost + head_cost + extra, (remaining,)
        options = []
        for count in range(remaining - stages_left + 1, 0, -1):
            rest_cost, rest = best(first + count, stages_left - 1)
            options.append((max(count * layer_cost + extra, rest_cost), (count, *rest)))
        return min(options, key=lambda option: option[0])

    return list(best(0, stages)[1])


@dataclass(frozen=True)
class StageLayers:
    """The part of the model one pipeline stage holds: its chunks of global layer indices, in
    the order its forward passes run them, and whether it holds the embedding and the head."""

    chunks: tuple[tuple[int, ...], ...]
    embedding: bool
    head: bool


@dataclass(frozen=True)
class PipelinePartition:
    """The layer split of a ``pp`` x ``vpp`` pipeline (``counts`` per virtual stage)."""

    pp: int
    vpp: int
    counts: tuple[int, ...]

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.vpp

    def layers_of(self, virtual_stage: int) -> list[int]:
        start = sum(self.counts[:virtual_stage])
        return list(range(start, start + self.counts[virtual_stage]))

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.pp + stage

    def chunks_of(self, stage: int) -> list[list[int]]:
        """Global layer indices of each chunk of ``stage``, chunk 0 first."""
        return [self.layers_of(self.virtual_stage(stage, c)) for c in range(self.vpp)]

    def holds_embedding(self, stage: int) -> bool:
        return stage == 0

    def holds_head(self, stage: int) -> bool:
        return stage == self.pp - 1

    def stage_layers(self, stage: int) -> StageLayers:
        """What the model of pipeline stage ``stage`` holds."""
        return StageLayers(tuple(tuple(c) for c in self.chunks_of(stage)),
                           self.holds_embedding(stage), self.holds_head(stage))

    def describe(self) -> str:
        """Layers per stage, e.g. ``3 | 1`` (``2+2 | 2+2`` with chunks)."""
        return " | ".join("+".join(str(len(c)) for c in self.chunks_of(s))
                          for s in range(self.pp))


def check_layer_split(cfg: ModelConfig, pp: int, vpp: int, explicit: list[int] | None) -> None:
    """Reject a split that cannot be made, saying what is needed."""
    stages = pp * vpp
    if explicit:
        if len(explicit) != stages:
            raise MeshtronError(
                f"parallel.pp_layers has {len(explicit)} entries, the pipeline has pp*vpp = "
                f"{pp}*{vpp} = {stages} virtual stages"
            )
        if min(explicit) < 1 or sum(explicit) != cfg.num_layers:
            raise MeshtronError(
                f"parallel.pp_layers={explicit} must give every virtual stage at least one layer "
                f"and sum to model.num_layers={cfg.num_layers}"
            )
        return
    if cfg.num_layers < stages:
        raise MeshtronError(
            f"a pipeline of pp*vpp = {pp}*{vpp} = {stages} virtual stages needs at least "
            f"{stages} layers, model.num_layers is {cfg.num_layers}; lower parallel.pp or "
            "parallel.vpp"
        )
    if vpp > 1 and cfg.num_layers % stages:
        raise MeshtronError(
            f"parallel.vpp={vpp} splits each stage's layers into {vpp} equal chunks: "
            f"model.num_layers={cfg.num_layers} must be divisible by pp*vpp = {stages} (or "
            "give parallel.pp_layers)"
        )


def partition_layers(cfg: ModelConfig, pp: int, vpp: int, costs: tuple[float, float],
                     explicit: list[int] | None = None,
                     first_cost: float = 0.0) -> PipelinePartition:
    """The split given by ``explicit`` (``parallel.pp_layers``) or the one balanced for
    ``costs``: the forward FLOPs per token of one layer and of the output layer, and
    ``first_cost`` of what the first stage runs before its layers."""
    check_layer_split(cfg, pp, vpp, explicit)
    stages = pp * vpp
    if explicit:
        return PipelinePartition(pp, vpp, tuple(explicit))
    if vpp > 1:  # interleaving assumes equal chunks, as in Megatron
        return PipelinePartition(pp, vpp, (cfg.num_layers // stages,) * stages)
    layer, head = costs
    counts = balanced_counts(cfg.num_layers, stages, layer, head, first_cost)
    return PipelinePartition(pp, vpp, tuple(counts))
