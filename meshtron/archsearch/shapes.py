"""The model shapes ``meshtron archsearch`` chooses among: a grid over depth, width, heads and kv
heads, FFN ratio and (for mixture-of-experts) experts and top-k, with the user's pins fixed.

A shape is only the fields the search changes; everything else about the model (architecture,
vocabulary, positions, norms, MoE routing settings) comes from the base config. The default
grid is centred on the budget (the shapes the budget trains on 0.5-800 tokens per parameter,
Chinchilla's compute-optimal 20 in the middle) and keeps the width-to-depth ratios that
published models use (16-192): within that range loss depends little on the aspect ratio
(Kaplan et al. 2020), which the law L(N, D) assumes.

The law's N is the non-embedding parameter count (Kaplan's choice: embeddings add capacity
far less than their count says, and at small sizes they would dominate). For a mixture of
experts the count a token meets (active) and the count the model holds (total) differ, and
neither alone predicts its loss: N = active^(1-g) x total^g with g = 1/2, the geometric mean,
an assumption in the spirit of Clark et al. 2022 (an expert layer is worth a dense layer of
sub-linearly many more parameters).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from meshtron.config import Config, ModelConfig
from meshtron.errors import MeshtronError
from meshtron.models.flops import mlp_matmul_params, model_size, training_flops_per_token

MOE_GAMMA = 0.5
"""The weight of the total (over the active) parameter count in a MoE model's law size."""
WIDTHS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
          8192, 12288, 16384, 24576)
DEPTHS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
ASPECT = (16.0, 192.0)
"""Width / depth of the default grid."""
TOKENS_PER_PARAM = (0.5, 800.0)
"""Tokens per parameter that the default grid spans: Chinchilla's compute-optimal 20 in the
(geometric) middle, about 6x either way in size."""
SHAPE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size",
                "moe.num_experts", "moe.top_k", "moe.expert_ffn_size")
"""The model fields a shape sets."""
PINNABLE = (*SHAPE_FIELDS, "head_dim")


@dataclass(frozen=True, order=True)
class Shape:
    """The searched fields of one model."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    num_experts: int = 0
    top_k: int = 0
    expert_ffn_size: int = 0

    def overrides(self) -> dict[str, int]:
        """The shape as config fields (the JSON's ``chosen``)."""
        fields = {"model.num_layers": self.num_layers, "model.hidden_size": self.hidden_size,
                  "model.num_heads": self.num_heads, "model.num_kv_heads": self.num_kv_heads,
                  "model.ffn_hidden_size": self.ffn_hidden_size,
                  "model.moe.num_experts": self.num_experts}
        if self.num_experts:
            fields.update({"model.moe.top_k": self.top_k,
                           "model.moe.expert_ffn_size": self.expert_ffn_size})
        return fields

    def describe(self) -> str:
        text = (f"{self.num_layers}x{self.hidden_size} h{self.num_heads}/kv{self.num_kv_heads} "
                f"ffn{self.ffn_hidden_size}")
        if self.num_experts:
            text += f" e{self.num_experts}k{self.top_k}x{self.expert_ffn_size}"
        return text

    def slug(self) -> str:
        """A file-name-safe name."""
        return self.describe().replace(" ", "_").replace("/", "-")


@dataclass(frozen=True)
class ShapeSpace:
    """The grid. ``head_dims`` None: a head width that grows with the model (16 up to 128)."""

    layers: tuple[int, ...]
    widths: tuple[int, ...]
    head_dims: tuple[int, ...] | None = None
    kv_groups: tuple[int, ...] = (1,)
    """Query heads per kv head (1: multi-head attention)."""
    ffn_ratios: tuple[float, ...] = (4.0,)
    experts: tuple[int, ...] = (0,)
    top_k: tuple[int, ...] = (2,)
    expert_ratio: float | None = None
    """Expert FFN size over width (None: the shape's FFN size)."""
    aspect: tuple[float, float] | None = None
    """Width / depth window (the default grid's)."""
    pins: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """``PINNABLE`` fields the user fixed (a pinned ``head_dim`` stays in the config)."""


def default_head_dim(hidden: int) -> int:
    return 128 if hidden >= 2048 else 64 if hidden >= 512 else 32 if hidden >= 128 else 16


def rounded_ffn(ratio: float, hidden: int) -> int:
    """ratio x hidden rounded up to a multiple of the width's largest power-of-two factor, at
    most 256 (Llama's rule: 8/3 x 4096 -> 11008)."""
    multiple = min(256, hidden & -hidden)
    return max(multiple, math.ceil(ratio * hidden / multiple) * multiple)


def shape_pins_of(given: Mapping[str, object]) -> dict[str, int]:
    """The shape fields the config file or command line set (``model.moe`` given as a mapping
    counts field by field)."""
    flat: dict[str, object] = {}
    for name, value in given.items():
        if name == "model.moe" and isinstance(value, dict):
            flat.update({f"moe.{k}": v for k, v in value.items()})
        elif name.startswith("model."):
            flat[name[len("model."):]] = value
    return {k: v for k, v in flat.items() if k in PINNABLE and isinstance(v, int)
            and not isinstance(v, bool)}


def base_ratios(m: ModelConfig) -> tuple[float, int, float | None]:
    """The base model's FFN ratio, query heads per kv head and expert ratio: the defaults of
    the grid's axes that the user does not give."""
    groups = max(1, m.num_heads // m.num_kv_heads) if m.num_kv_heads else 1
    expert = m.moe.expert_ffn_size / m.hidden_size if m.is_moe else None
    return m.ffn_hidden_size / m.hidden_size, groups, expert


def default_grid(budget_flops: float, m: ModelConfig, seq_len: int
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Depths and widths of the default grid: the pairs (within ``ASPECT``) that the budget
    trains on ``TOKENS_PER_PARAM`` tokens per non-embedding parameter, the whole training
    FLOPs per token counted (at small widths the output layer costs more than the blocks, so
    a rule on parameters alone would centre the grid too high). ``m`` has its vocabulary."""
    pairs, cost = [], {}
    for layers in DEPTHS:
        for width in WIDTHS:
            if not ASPECT[0] <= width / layers <= ASPECT[1]:
                continue
            heads = width // default_head_dim(width)
            model = dataclasses.replace(
                m, num_layers=layers, hidden_size=width, num_heads=heads, num_kv_heads=heads,
                head_dim=None, ffn_hidden_size=rounded_ffn(m.ffn_hidden_size / m.hidden_size,
                                                           width),
                moe=dataclasses.replace(m.moe, num_experts=0), mtp_depth=0)
            fpt = training_flops_per_token(model, seq_len)
            cost[layers, width] = fpt
            per_param = budget_flops / fpt / sizes_of(model).total
            if TOKENS_PER_PARAM[0] <= per_param <= TOKENS_PER_PARAM[1]:
                pairs.append((layers, width))
    if not pairs:  # a budget below the smallest shapes: keep those, the budget check says so
        pairs = sorted(cost, key=cost.get)[:2]
    return (tuple(sorted({p[0] for p in pairs})), tuple(sorted({p[1] for p in pairs})))


def enumerate_shapes(space: ShapeSpace) -> Iterator[Shape]:
    """Every shape of the grid whose own fields divide (heads into the width, kv heads into
    the heads); the config and plan checks come later, with the layout."""
    pins = space.pins
    layers = [pins["num_layers"]] if "num_layers" in pins else space.layers
    widths = [pins["hidden_size"]] if "hidden_size" in pins else space.widths
    experts = [pins["moe.num_experts"]] if "moe.num_experts" in pins else space.experts
    seen: set[Shape] = set()
    for depth in layers:
        for width in widths:
            if space.aspect and not ({"num_layers", "hidden_size"} & set(pins)) and not \
                    space.aspect[0] <= width / depth <= space.aspect[1]:
                continue
            for heads in _heads(space, width):
                for kv in _kv_heads(space, heads):
                    for ffn in _ffns(space, width):
                        for count in experts:
                            for shape in _moe_variants(space, depth, width, heads, kv, ffn,
                                                       count):
                                if shape not in seen:
                                    seen.add(shape)
                                    yield shape


def _heads(space: ShapeSpace, width: int) -> list[int]:
    pins = space.pins
    if "num_heads" in pins:
        return [pins["num_heads"]]
    if "head_dim" in pins:
        dims = [pins["head_dim"]]
    else:
        dims = list(space.head_dims or (default_head_dim(width),))
    return sorted({width // d for d in dims if d > 0 and width % d == 0 and width >= d})


def _kv_heads(space: ShapeSpace, heads: int) -> list[int]:
    if "num_kv_heads" in space.pins:
        kv = space.pins["num_kv_heads"]
        return [kv] if kv > 0 and heads % kv == 0 else []
    return sorted({heads // g for g in space.kv_groups if g > 0 and heads % g == 0})


def _ffns(space: ShapeSpace, width: int) -> list[int]:
    if "ffn_hidden_size" in space.pins:
        return [space.pins["ffn_hidden_size"]]
    return sorted({rounded_ffn(r, width) for r in space.ffn_ratios if r > 0})


def _moe_variants(space: ShapeSpace, depth: int, width: int, heads: int, kv: int, ffn: int,
                  count: int) -> Iterator[Shape]:
    if count <= 0:
        yield Shape(depth, width, heads, kv, ffn)
        return
    pins = space.pins
    tops = [pins["moe.top_k"]] if "moe.top_k" in pins else space.top_k
    if "moe.expert_ffn_size" in pins:
        expert = pins["moe.expert_ffn_size"]
    else:
        expert = rounded_ffn(space.expert_ratio, width) if space.expert_ratio else ffn
    for k in tops:
        if 0 < k <= count:
            yield Shape(depth, width, heads, kv, ffn, count, k, expert)


def shape_config(cfg: Config, shape: Shape) -> Config:
    """``cfg`` with the shape's model (its other model fields untouched)."""
    m = cfg.model
    moe = dataclasses.replace(m.moe, num_experts=shape.num_experts)
    if shape.num_experts:
        moe = dataclasses.replace(moe, top_k=shape.top_k, expert_ffn_size=shape.expert_ffn_size)
    model = dataclasses.replace(
        m, num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        ffn_hidden_size=shape.ffn_hidden_size, moe=moe)
    return dataclasses.replace(cfg, model=model)


@dataclass(frozen=True)
class Sizes:
    total: int
    """Non-embedding parameters (the multi-token-prediction modules left out)."""
    active: int
    """Of them, what one token uses (the routed experts it is not sent to left out)."""

    @property
    def law(self) -> float:
        """N of the scaling law (see the module docstring)."""
        if self.active == self.total:
            return float(self.total)
        return self.active ** (1 - MOE_GAMMA) * self.total ** MOE_GAMMA


def sizes_of(m: ModelConfig) -> Sizes:
    """Parameter counts of a model with its vocabulary resolved (``models/flops.py``)."""
    size = model_size(m)
    total = size.non_embedding_params - size.mtp_params
    idle = 0
    if m.is_moe:
        per_expert = mlp_matmul_params(m, m.moe.expert_ffn_size)
        idle = sum((m.moe.num_experts - m.moe.top_k) * per_expert
                   for layer in range(m.num_layers) if m.is_moe_layer(layer))
    if total <= 0:
        raise MeshtronError(f"a model of {m.num_layers} layers x {m.hidden_size} has no "
                            "non-embedding parameters")
    return Sizes(total, total - idle)
