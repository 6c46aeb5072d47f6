"""The fastest any pipeline of ``benchmarks/pipeline.py``'s model can be: parts' costs, splits.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_bound.py [--rounds N] [--pp 2 4] [--json OUT]

**What is measured.** The model is ``pipeline.py``'s (``Shape``: meshtron's ``Transformer``,
8 llama layers of hidden 256, vocab 4096, fp32), in one process with one thread. For one
micro-batch (2 x 128 tokens) the script times forward + backward of each part a pipeline
stage can hold:

- ``embedding``: the token embedding (the first stage's extra work);
- ``attention half``: a layer's norm, attention and residual add;
- ``MLP half``: a layer's second norm, MLP and residual add;
- ``layer``: a whole layer;
- ``head``: the final norm, output layer and loss (the last stage's extra work).

Each part runs once per round, in an order that rotates every round, after 3 warm-up rounds;
a part's cost is its median over the rounds.

**What is derived.** A stage's compute per micro-batch is the sum of its parts. The step of any
schedule is at least ``micro-batches x`` the busiest stage's compute. For each ``pp`` the script
gives the busiest stage of five splits:

- the even split, ``L / pp`` layers a stage: torch's stages in ``pipeline.py``;
- the best split in whole layers: meshtron's balanced split, here fed measured costs;
- the best split in half layers, a stage boundary also allowed between a layer's attention
  and its MLP (halves scaled so that they add up to the measured whole layer);
- a perfect split: the total over ``pp``, no finer than the largest single part;
- zb-v's V in half layers: meshtron's zb-v split (``partition.v_counts``, no layer cut at the
  turn of the V), stage ``s`` holding virtual stages ``s`` and ``2 * pp - 1 - s``, so that the
  first stage runs the embedding and the head.

Each is also given as a ratio to the even split: the lowest step-time ratio that balancing
alone can reach against the even split. Bubbles, communication and the optimizer step come on
top of all alike.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import asdict

import harness
import torch
from pipeline_shape import Shape

from meshtron.models.init import initialize
from meshtron.models.transformer import Transformer
from meshtron.parallel.pipeline.partition import balanced_split, v_counts

PARTS = ("embedding", "attention half", "MLP half", "layer", "head")


def part_steps(s: Shape) -> dict[str, Callable[[], None]]:
    """Forward + backward of one micro-batch through each part of a seeded model."""
    cfg = s.config().model
    model = Transformer(cfg).train()
    initialize(model, seed=0, std=cfg.init_std, num_layers=cfg.num_layers)
    block = model.layers["0"]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(s.micro_batch, s.seq, s.hidden, generator=gen, requires_grad=True)
    tokens = torch.randint(0, s.vocab, (s.micro_batch, s.seq), generator=gen)

    def embedding() -> None:
        model.embed_tokens(tokens, 0).sum().backward()

    def attention() -> None:
        (hidden + block.attn(block.attn_norm(hidden), model.rotary)).sum().backward()

    def mlp() -> None:
        (hidden + block.mlp(block.mlp_norm(hidden))).sum().backward()

    def layer() -> None:
        block(hidden, model.rotary).sum().backward()

    def head() -> None:
        logits = model.readout(model.final_norm(hidden))
        model.loss_sum(logits.flatten(0, 1), tokens.flatten()).backward()

    return dict(zip(PARTS, (embedding, attention, mlp, layer, head), strict=True))


def busiest(pieces: list[float], stages: int, first: float, head: float,
            v_split: list[int] | None = None) -> tuple[float, list[int]]:
    """meshtron's balanced split of ``pieces`` over ``stages`` virtual stages (``first`` and
    ``head`` charged to the first and last), or ``v_split`` (pieces per virtual stage, 2 per
    stage in a V): the costliest stage and the pieces per virtual stage."""
    vshape = v_split is not None
    counts = v_split if vshape else balanced_split(pieces, stages, head, first)
    bounds = [sum(counts[:i]) for i in range(stages + 1)]
    costs = [sum(pieces[a:b]) for a, b in zip(bounds, bounds[1:])]
    costs[0] += first
    costs[-1] += head
    if vshape:
        costs = [a + b for a, b in zip(costs, reversed(costs))][:stages // 2]
    return max(costs), counts


Split = tuple[float, list[float] | None]
"""The busiest stage's compute (ms per micro-batch) and the layers per stage (None: a
continuous split)."""


def splits(ms: dict[str, float], layers: int, pp: int) -> dict[str, Split]:
    """Each split of ``layers`` over ``pp`` stages; the embedding rides on the first stage,
    the head on the last."""
    layer, embed, head = ms["layer"], ms["embedding"], ms["head"]
    attention = layer * ms["attention half"] / (ms["attention half"] + ms["MLP half"])

    per_stage = layers // pp
    even = per_stage * layer + max(embed, head)  # pp >= 2: the ends on two stages
    by_layers, layer_counts = busiest([layer] * layers, pp, embed, head)
    halves = [attention, layer - attention] * layers
    by_halves, half_counts = busiest(halves, pp, embed, head)
    planned = [round(2 * c) for c in v_counts(layers, pp, layer, head, embed, attention)]
    by_v, v_halves = busiest(halves, 2 * pp, embed, head, v_split=planned)
    total = layers * layer + embed + head
    return {"even": (even, [float(per_stage)] * pp),
            "whole layers": (by_layers, [float(c) for c in layer_counts]),
            "half layers": (by_halves, [c / 2 for c in half_counts]),
            "perfect": (max(total / pp, head, layer), None),
            "V (zb-v), half layers": (by_v, [c / 2 for c in v_halves])}


def measure(s: Shape, rounds: int) -> dict[str, float]:
    """Each part's median forward + backward, ms (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = harness.interleave(part_steps(s), rounds, warmup=3)
    torch.set_num_threads(threads)
    return {part: 1e3 * statistics.median(runs.wall[part]) for part in PARTS}


def half_layer_splits(s: Shape, pp: int, rounds: int = 30) -> dict[int, list[float]]:
    """Layers per virtual stage of the half-layer splits that balance the measured costs: {1:
    one chunk per stage, 2: zb-v's V}."""
    found = splits(measure(s, rounds), s.layers, pp)
    one, v = found["half layers"][1], found["V (zb-v), half layers"][1]
    assert one is not None and v is not None
    return {1: one, 2: v}


def main() -> None:
    cli = harness.cli
    parser = cli.parser(__doc__, cli.rounds(30, "timed rounds (each part once a round)"))
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes")
    args = parser.parse_args()
    s = Shape()
    if any(pp < 2 or s.layers % pp for pp in args.pp):
        parser.error(f"--pp: each size at least 2 and dividing the {s.layers} layers")
    info = harness.host_info()
    print(harness.host_line(info, "1 process, 1 thread"), flush=True)
    print(f"llama {s.layers} x {s.hidden} (ffn {s.ffn}, vocab {s.vocab}), micro-batch "
          f"{s.micro_batch} x {s.seq} tokens, fp32; forward + backward, median of "
          f"{args.rounds} rounds\n")
    ms = measure(s, args.rounds)
    print(harness.markdown_table(("part", "ms", "in layers"),
                                 ((p, f"{ms[p]:.2f}", f"{ms[p] / ms['layer']:.2f}")
                                  for p in PARTS)))
    results = {}
    for pp in args.pp:
        results[pp] = splits(ms, s.layers, pp)
        print(f"\npp={pp}: the busiest stage's compute per micro-batch (layers per virtual "
              "stage)\n")
        even = results[pp]["even"][0]
        print(harness.markdown_table(
            ("split", "layers per stage", "ms", "vs even"),
            ((name, " + ".join(f"{c:g}" for c in counts) if counts else "continuous",
              f"{v:.2f}", f"{v / even:.3f}") for name, (v, counts) in results[pp].items())))
    print(f"\nload average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    harness.write_json(args.json, harness.record(
        info, shape=asdict(s), args=harness.plain_args(args), part_ms=ms,
        splits={str(pp): {name: {"busiest_stage_ms": v, "layers_per_stage": counts}
                          for name, (v, counts) in r.items()} for pp, r in results.items()}))


if __name__ == "__main__":
    main()
