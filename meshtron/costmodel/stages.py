"""The distinct shapes of a pipeline's stages, so each is priced once however many there are.

A balanced split of 96 layers over 32 stages has a handful of different stages (the first with
the embedding, the last with the head, middle ones of n or n+1 layers); what a stage costs
depends only on how many dense and mixture-of-experts layers each of its chunks holds and on
whether it holds the embedding or the head, so stages of one shape share their prices.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.config import ModelConfig
from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.priced import ActionCosts
from meshtron.parallel.pipeline.partition import PipelinePartition, virtual_stage_of


@dataclass(frozen=True)
class ChunkShape:
    dense: int
    moe: int
    heads: int
    """Output layers it computes: 1 + the multi-token-prediction depth on the last virtual
    stage, whose modules' layers are counted in ``dense`` / ``moe`` too; else 0."""
    receives: bool
    """Its forward input arrives from the previous virtual stage."""
    sends_back: bool
    """Its backward receives a gradient from the next virtual stage."""


@dataclass(frozen=True)
class StageShape:
    chunks: tuple[ChunkShape, ...]
    embedding: bool
    head: bool

    @property
    def layers(self) -> int:
        return sum(c.dense + c.moe for c in self.chunks)


def stage_shapes(cfg: ModelConfig, part: PipelinePartition) -> list[StageShape]:
    """The shape of every pipeline stage, stage 0 first."""
    last = part.virtual_stages - 1
    mtp = range(cfg.num_layers, cfg.num_layers + cfg.mtp_depth)
    shapes = []
    for stage in range(part.pp):
        chunks = []
        for chunk, layers in enumerate(part.chunks_of(stage)):
            virtual = part.virtual_stage(stage, chunk)
            held = list(layers) + (list(mtp) if virtual == last else [])
            moe = sum(cfg.is_moe_layer(i) for i in held)
            chunks.append(ChunkShape(len(held) - moe, moe,
                                     1 + cfg.mtp_depth if virtual == last else 0,
                                     virtual > 0, virtual < last))
        shapes.append(StageShape(tuple(chunks), part.holds_embedding(stage),
                                 part.holds_head(stage)))
    return shapes


def representative_layers(cfg: ModelConfig) -> tuple[int | None, int | None]:
    """A dense layer's and a mixture-of-experts layer's global index (None where the model has
    no such layer): every layer of a kind has the same size and cost."""
    dense = next((i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)), None)
    moe = next((i for i in range(cfg.num_layers + cfg.mtp_depth) if cfg.is_moe_layer(i)), None)
    if dense is None and cfg.mtp_depth and not cfg.is_moe_layer(cfg.num_layers):
        dense = cfg.num_layers
    return dense, moe


def zb_v_order_costs(c: Candidate, shapes: list[StageShape],
                     costs: dict[ChunkShape, ActionCosts]) -> list[tuple[float, float, float]]:
    """Each virtual stage's (F, B, W) seconds, which zb-v's order is made for (the plan,
    which has only FLOPs, prices the three alike)."""
    order = [(0.0, 0.0, 0.0)] * (c.pp * c.vpp)
    for stage, shape in enumerate(shapes):
        for chunk, piece in enumerate(shape.chunks):
            a = costs[piece]
            order[virtual_stage_of(c.pp, stage, chunk, True)] = (a.forward, a.backward,
                                                                 a.weight)
    return order
