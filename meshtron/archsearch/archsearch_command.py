"""``meshtron archsearch``: choose a model shape for a compute budget.

The steps, each in its own module: the grid of shapes with the user's pins
(:mod:`~meshtron.archsearch.shapes`); what the budget buys each and whether it fits in memory
(:mod:`~meshtron.archsearch.shape_cost`), checked before anything trains, so an empty space or a
budget too small is said at once; short proxy runs of a few shapes through the real trainer
(:mod:`~meshtron.archsearch.proxy_runs`) and the law L(N, D) fitted to them
(:mod:`~meshtron.archsearch.scaling_law`); every shape's predicted loss at the budget (on a cluster
with the tokens its best layout trains in the time), the lowest chosen; the front, table, plot,
JSON and config (:mod:`~meshtron.archsearch.report`). See docs/archsearch.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

from meshtron.archsearch import report
from meshtron.archsearch.proxy_rounds import ProxySettings, fitted_law, proxy_flops
from meshtron.archsearch.scaling_law import ScalingLaw
from meshtron.archsearch.shape_cost import Budget, Priced, Pricer, budget_of
from meshtron.archsearch.shapes import (
    SHAPE_FIELDS,
    ShapeSpace,
    base_ratios,
    default_grid,
    enumerate_shapes,
    shape_pins_of,
)
from meshtron.config import Config, load_config, parse_override
from meshtron.costmodel.memory_model import with_vocab
from meshtron.costmodel.search import Pins
from meshtron.errors import MeshtronError
from meshtron.tune.tune_command import (
    check_pins,
    cluster_of,
    given_fields,
    layout_pins_of,
    planning_defaults,
    split_cluster,
)

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10,
         "mib": 2**20, "gib": 2**30, "tib": 2**40}


def numbers(text: str | None, flag: str, kind: type = int) -> tuple | None:
    """A comma-separated list of positive numbers (or None when not given)."""
    if text is None:
        return None
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise MeshtronError(f"{flag} {text}: expected comma-separated "
                            f"{'whole numbers' if kind is int else 'numbers'}") from None
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise MeshtronError(f"{flag} {text}: expected non-negative numbers")
    return values


def memory_bytes(text: str | None) -> float | None:
    """``--memory-limit``: bytes, with an optional unit (8e9, 40GB, 16GiB)."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    try:
        value = float(match.group(1)) * UNITS[unit] if match and unit in UNITS else None
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise MeshtronError(f"--memory-limit {text}: expected a positive size such as 8e9, "
                            "40GB or 16GiB")
    return value


def sets_shape_field(override: str) -> bool:
    section, key, _ = parse_override(override)
    return section == "model" and key in SHAPE_FIELDS


def space_of(args: argparse.Namespace, cfg: Config, budget: Budget,
             given: dict[str, object], proxy: bool = False) -> ShapeSpace:
    """The grid from the flags, the base model's ratios and the budget."""
    m = cfg.model
    ffn_ratio, groups, expert_ratio = base_ratios(m)
    layers = numbers(args.proxy_layers if proxy and args.proxy_layers else args.layers,
                     "--layers")
    widths = numbers(args.proxy_widths if proxy and args.proxy_widths else args.widths,
                     "--widths")
    default_layers, default_widths = default_grid(
        budget.flops, with_vocab(m, cfg.data.vocab_size), cfg.train.seq_len)
    return ShapeSpace(
        layers=layers or default_layers, widths=widths or default_widths,
        head_dims=numbers(args.head_dims, "--head-dims"),
        kv_groups=numbers(args.kv_groups, "--kv-groups") or (groups,),
        ffn_ratios=numbers(args.ffn_ratios, "--ffn-ratios", float) or (ffn_ratio,),
        experts=numbers(args.experts, "--experts") or ((m.moe.num_experts,) if m.is_moe
                                                       else (0,)),
        top_k=numbers(args.top_k, "--top-k") or (m.moe.top_k,),
        expert_ratio=expert_ratio,
        aspect=None if layers and widths else (16.0, 192.0),
        pins=shape_pins_of(given))


def priced_space(pricer: Pricer, space: ShapeSpace) -> tuple[list[Priced], dict[str, float]]:
    """Every shape that is valid, fits and gets enough steps (first pass); one clear error
    when none is left."""
    shapes = list(enumerate_shapes(space))
    pinned = ", ".join(f"model.{k}={v}" for k, v in space.pins.items()) or "none"
    if not shapes:
        raise MeshtronError(f"the search space is empty: no shape of the grid (layers "
                            f"{list(space.layers)}, widths {list(space.widths)}) has heads that "
                            f"divide its width and kv heads that divide its heads (pins: "
                            f"{pinned}); widen the grid or drop a pin")
    valid, reason = [], ""
    for shape in shapes:
        try:
            valid.append(pricer.first_pass(shape))
        except MeshtronError as err:
            reason = reason or f"{shape.describe()}: {err}"
    if not valid:
        raise MeshtronError(f"the search space is empty: none of its {len(shapes)} shapes is "
                            f"valid (the first, {reason}); widen the grid or drop a pin")
    fitting = [p for p in valid if p.fits]
    where = "per GPU" if pricer.cluster else "per process"
    if not fitting:
        least = min(valid, key=lambda p: p.memory_bytes)
        raise MeshtronError(f"the search space is empty after pruning: no shape fits in "
                            f"{pricer.limit / 2**30:,.3g} GiB {where} (the smallest, "
                            f"{least.shape.describe()}, needs {least.memory_bytes / 2**30:,.3g} "
                            "GiB); raise --memory-limit or give smaller --layers/--widths")
    affordable = [p for p in fitting if p.steps >= pricer.min_steps]
    if not affordable:
        cheapest = min(fitting, key=lambda p: p.flops_per_token)
        need = cheapest.flops_per_token * pricer.min_steps * pricer.tokens_per_step
        raise MeshtronError(f"the budget ({pricer.budget.describe()}) is too small for any "
                            f"shape: the cheapest, {cheapest.shape.describe()}, gets "
                            f"{cheapest.steps} optimizer steps of {pricer.tokens_per_step:,} "
                            f"tokens (at least {pricer.min_steps} needed); give at least "
                            f"{need:.3g} FLOPs, smaller shapes or a smaller batch")
    counts = {"shapes": len(shapes), "valid": len(valid), "fitting": len(fitting),
              "affordable": len(affordable)}
    return affordable, counts


def predicted(pricer: Pricer, first: list[Priced], law: ScalingLaw, search_top: int
              ) -> tuple[list[Priced], str]:
    """Every shape's predicted loss at the budget. On a cluster the layouts are searched in
    the order of the bound (tokens at 100% MFU), which no layout beats: once ``search_top``
    shapes fit and the next bound is above the best found, no shape left can win."""
    for p in first:
        p.loss = law.loss(p.sizes.law, p.tokens)
    if pricer.cluster is None:
        return first, ""
    ordered = sorted(first, key=lambda p: p.loss)
    found: list[Priced] = []
    limit = 4 * max(search_top, 1)
    for i, bound in enumerate(ordered):
        if found and len(found) >= search_top and bound.loss > report.best(found).loss:
            return found, f"{i} of {len(ordered)} shapes searched (the rest cannot win)"
        if i >= limit:
            return found, (f"{i} of {len(ordered)} shapes searched (--search-top "
                           f"{search_top}); a shape not searched might beat the choice")
        exact = pricer.searched(bound.shape)
        if exact.fits and exact.steps >= pricer.min_steps:
            exact.loss = law.loss(exact.sizes.law, exact.tokens)
            found.append(exact)
    if not found:
        raise MeshtronError(f"the search space is empty after pruning: no shape has a layout "
                            f"on {pricer.cluster.gpus} x {pricer.cluster.profile.name} that fits "
                            f"in {pricer.limit / 2**30:,.3g} GiB per GPU and gets "
                            f"{pricer.min_steps} steps; raise --memory-limit, the budget or "
                            "--cluster.gpus, or give smaller shapes")
    return found, f"all {len(ordered)} shapes searched"


def edge_note(chosen: Priced, priced: list[Priced]) -> str:
    """Said when the choice is the smallest or largest shape priced: the optimum may lie
    beyond the grid."""
    sizes = [p.sizes.law for p in priced]
    if len(set(sizes)) < 2 or min(sizes) < chosen.sizes.law < max(sizes):
        return ""
    side = "smallest" if chosen.sizes.law == min(sizes) else "largest"
    return (f"note: the choice is the {side} shape of the grid, so the best shape may lie "
            f"beyond it: extend --widths/--layers {'down' if side == 'smallest' else 'up'}")


def run_archsearch(args: argparse.Namespace, extra: list[str]) -> int:
    """The ``archsearch`` command, after the CLI has parsed its arguments."""
    where, overrides = split_cluster(extra)
    given = given_fields(args.config, overrides)
    # a pinned shape field is checked with each shape, not against the preset's other fields
    cfg = load_config(args.config, [o for o in overrides if not sets_shape_field(o)])
    cluster = cluster_of(where) if where else None
    if args.nproc < 1:
        raise MeshtronError(f"--nproc must be at least 1, got {args.nproc}")
    plan_cfg, layout_pins = cfg, Pins()
    if cluster is not None:
        plan_cfg, defaults = planning_defaults(cfg, given, cluster)
        if "train.global_batch" not in given:  # a cluster-sized batch: about 1M tokens
            t = plan_cfg.train
            batch = max(t.global_batch, 2 ** round(math.log2(max(1, 2**20 // t.seq_len))))
            plan_cfg = dataclasses.replace(plan_cfg, train=dataclasses.replace(
                t, global_batch=batch))
            defaults = [d for d in defaults if not d.startswith("train.global_batch")] + [
                f"train.global_batch={batch}"]
        if defaults:
            print(f"planning with {', '.join(defaults)} (unset; set them for your run)")
        layout_pins = layout_pins_of(given)
        check_pins(plan_cfg, layout_pins, cluster)
    p = plan_cfg.precision
    dtype = "fp8" if p.fp8 != "none" and cluster and "fp8" in cluster.profile.peak_flops \
        else p.dtype
    budget = budget_of(args.budget_flops, args.budget_gpu_hours, cluster, dtype)
    pricer = Pricer(plan_cfg, budget, memory_bytes(args.memory_limit), args.nproc, layout_pins)
    space = space_of(args, cfg, budget, given)
    first, counts = priced_space(pricer, space)
    where_text = (f"{cluster.gpus} x {cluster.profile.name}" if cluster
                  else f"{args.nproc} process{'es' if args.nproc > 1 else ''} here")
    print(f"budget {budget.describe()}: {counts['shapes']} shapes in the grid, "
          f"{counts['valid']} valid, {counts['fitting']} fit in {pricer.limit / 2**30:,.3g} "
          f"GiB per rank on {where_text}, {counts['affordable']} get at least "
          f"{pricer.min_steps} steps", flush=True)
    settings = ProxySettings(args.proxies, args.proxy_fraction, args.proxy_steps,
                             args.proxy_points, args.nproc, args.proxy_timeout, args.proxy_dir,
                             args.refine, args.max_minutes)
    law, fit, source, proxies = fitted_law(cfg, settings, budget,
                                           space_of(args, cfg, budget, given, proxy=True),
                                           first, args.law)
    priced, searched = predicted(pricer, first, law, args.search_top)
    priced = report.finite(priced)
    chosen = report.best(priced)
    front = report.pareto_front(priced)
    print("\n".join(report.fit_lines(fit, law, source)))
    spent = proxy_flops(cfg, proxies)
    if spent:
        print(f"proxy runs: {spent:.3g} FLOPs in all, {spent / budget.flops:.2f}x the budget")
    if searched:
        print(f"layouts: {searched}")
    ranked = sorted(priced, key=lambda q: q.loss)
    if args.top > 0:
        print(f"best {min(args.top, len(ranked))} of {len(ranked)} shapes by predicted loss "
              "(* on the front):")
        print("\n".join(report.table(ranked[:args.top], cluster is not None, front)))
    print(f"Pareto front, predicted loss vs training FLOPs per token ({len(front)} shapes):")
    print("\n".join(report.table(front, cluster is not None)))
    edge = edge_note(chosen, priced)
    if edge:
        print(edge)
    print(f"chosen: {chosen.shape.describe()}, predicted loss {chosen.loss:.4f} after "
          f"{chosen.tokens:.4g} tokens ({chosen.steps:,} steps of "
          f"{pricer.tokens_per_step:,})" + (f" as {chosen.estimate.candidate.describe()}"
                                           if chosen.estimate else ""))
    if args.json:
        document = report.payload(budget, chosen, front, priced, law, fit, source, proxies,
                                       {**counts, "proxy_flops": spent})
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    if args.plot:
        report.plot(Path(args.plot), priced, front, chosen, law, proxies)
    if args.output_config:
        path = report.write_config(plan_cfg, chosen, Path(args.output_config), budget)
        print(f"wrote {path}: meshtron train --config {path}", file=sys.stderr)
    return 0
