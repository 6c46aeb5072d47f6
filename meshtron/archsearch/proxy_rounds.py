"""The law ``meshtron archsearch`` predicts with: given (``--law``), or fitted to proxy runs.

Proxy runs are spent in two rounds. The first trains ``count`` shapes log-spaced in size, each
on ``fraction`` of the budget up to 1e11 FLOPs and sub-linearly beyond (:func:`proxy_flops_of`;
or ``steps`` steps), and fits the law to all of them. The law's
predictions matter most where the choice is made, and its error is largest where it
extrapolates furthest in tokens, so the second round (``refine``) trains the shapes the first
law ranks best to twice as far (a proxy already among them is extended: at a constant learning
rate its longer run is the same run continued from its last checkpoint) and the law is fitted
again to every point. A proxy that fails is reported and left out; too few left is one error.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from meshtron.archsearch.proxy_runs import (
    Deadline,
    Proxy,
    ProxyResult,
    choose,
    plan_line,
    proxy_config,
    run_proxies,
)
from meshtron.archsearch.scaling_law import Fit, ScalingLaw, fit_law, parse_law
from meshtron.archsearch.shape_cost import MIN_STEPS, Budget, Priced
from meshtron.archsearch.shapes import Shape, ShapeSpace, enumerate_shapes, sizes_of
from meshtron.config import Config, validate
from meshtron.config.checks import SANITY_LIMITS
from meshtron.costmodel.memory_model import with_vocab
from meshtron.data.cache import scratch as scratch_dir
from meshtron.errors import MeshtronError
from meshtron.models.flops import training_flops_per_token
from meshtron.plan import check_run


@dataclass(frozen=True)
class ProxySettings:
    """The ``--proxy-*`` flags."""

    count: int = 6
    fraction: float = 0.25
    steps: int | None = None
    """Steps of every first-round proxy (instead of ``fraction``)."""
    points: int = 8
    nproc: int = 1
    timeout_s: float = 1800.0
    folder: str | None = None
    refine: int = 2
    """Shapes of the second round (0: none)."""
    max_minutes: float | None = None
    """``--max-minutes``: no proxy starts after it; the fit uses what finished."""


def check_settings(s: ProxySettings, budget: Budget) -> None:
    if s.count < 2:
        raise MeshtronError(f"--proxies must be at least 2 (a fit needs two sizes), got "
                            f"{s.count}")
    if s.points < 2:
        raise MeshtronError(f"--proxy-points must be at least 2, got {s.points}")
    if s.max_minutes is not None and not s.max_minutes > 0:
        raise MeshtronError(f"--max-minutes must be a positive number of minutes, got "
                            f"{s.max_minutes:g}")
    if s.refine < 0:
        raise MeshtronError(f"--refine must not be negative, got {s.refine}")
    if s.steps is None and budget.cluster is not None:
        raise MeshtronError("with a cluster the proxy runs still train on this machine: give "
                            "--proxy-steps S (and --proxy-layers/--proxy-widths of shapes it "
                            "trains), or a law with --law")
    if s.steps is None and not 0 < s.fraction <= 1:
        raise MeshtronError(f"--proxy-fraction must be in (0, 1], got {s.fraction}")
    if s.steps is not None and s.steps < 1:
        raise MeshtronError(f"--proxy-steps must be positive, got {s.steps}")


def least_steps(cfg: Config, s: ProxySettings) -> int:
    """A proxy's fewest steps: past 4x the warm-up, with room for its evaluations."""
    return max(MIN_STEPS, 4 * cfg.train.warmup_steps, 2 * s.points)


def proxy_of(cfg: Config, s: ProxySettings, budget: Budget, shape: Shape, scale: float
             ) -> Proxy | str:
    """The proxy of ``shape`` at ``scale`` times the first round's length, or why not."""
    run = proxy_config(cfg, Proxy(shape, 1.0, least_steps(cfg, s)), s.points, Path("unused"))
    try:
        validate(run)
        check_run(run, s.nproc)
    except MeshtronError as err:
        return f"{shape.describe()}: {err}"
    model = with_vocab(run.model, run.data.vocab_size)
    fpt = training_flops_per_token(model, cfg.train.seq_len)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    if s.steps is not None:
        steps = at_scale = int(s.steps * scale)
    else:
        flops = min(budget.flops, proxy_flops_of(budget.flops, s.fraction) * scale)
        steps = int(flops / fpt // tokens)
        # the proxies grow sub-linearly, so an absurd budget is judged at its own scale: the
        # share of it a proxy would have trained on were it linear
        at_scale = int(min(budget.flops, s.fraction * budget.flops * scale) / fpt // tokens)
    if steps < least_steps(cfg, s):
        return f"{shape.describe()}: {steps} steps"
    if max(steps, at_scale) > SANITY_LIMITS["train.steps"]:  # before any proxy trains
        raise MeshtronError(f"the budget ({budget.describe()}) is {at_scale:.3g} steps of "
                            f"{shape.describe()} at its scale, more than a run may have "
                            f"({SANITY_LIMITS['train.steps']:.0e}); lower the budget, or give "
                            "--proxy-steps or --law")
    return Proxy(shape, sizes_of(model).law, steps, fpt)


PROXY_REFERENCE_FLOPS = 1e11
"""Up to this budget a first-round proxy trains on ``--proxy-fraction`` of it; beyond, on that
fraction of the geometric mean of the budget and this."""


def proxy_flops_of(budget_flops: float, fraction: float) -> float:
    """What one first-round proxy trains on: sub-linear in the budget, since the proxies are
    for the law's shape, not the budget (a 100x budget buys proxies 10x as long; the README's
    4e12 example six times shorter proxies than a quarter of its budget)."""
    if budget_flops <= PROXY_REFERENCE_FLOPS:
        return fraction * budget_flops
    return fraction * math.sqrt(budget_flops * PROXY_REFERENCE_FLOPS)


def first_round(cfg: Config, s: ProxySettings, budget: Budget, space: ShapeSpace
                ) -> list[Proxy]:
    """``count`` proxies log-spaced in size among the shapes that can train as one."""
    candidates, reason = [], ""
    for shape in enumerate_shapes(space):
        proxy = proxy_of(cfg, s, budget, shape, 1.0)
        if isinstance(proxy, Proxy):
            candidates.append(proxy)
        else:
            reason = reason or f" (the first, {proxy})"
    if not candidates:
        raise MeshtronError(f"no proxy run is possible{reason}: each needs at least "
                            f"{least_steps(cfg, s)} steps (4x the warm-up, and 2 per "
                            "--proxy-points); raise --proxy-fraction or --proxy-steps, or "
                            "give smaller --proxy-layers/--proxy-widths")
    if len({p.n for p in candidates}) < 2:  # said now, not after the one proxy has trained
        raise MeshtronError(f"only one size of shape ({candidates[0].shape.describe()}) can "
                            "train as a proxy at this budget, and the fit needs two: each "
                            f"proxy needs at least {least_steps(cfg, s)} steps (4x the "
                            "warm-up, and 2 per --proxy-points); lower --train.warmup_steps, "
                            "raise --proxy-fraction or give --proxy-steps, or give --law")
    return choose(candidates, s.count)


def proxy_flops(cfg: Config, results: list[ProxyResult]) -> float:
    """What the proxy runs cost in all (each run to its last step)."""
    tokens = cfg.train.global_batch * cfg.train.seq_len
    return sum(r.proxy.steps * tokens * r.proxy.flops_per_token for r in results)


def fit_results(results: list[ProxyResult]) -> tuple[Fit, str]:
    """The law fitted to every finished proxy; one error when too few finished."""
    done = [r for r in results if r.failure is None]
    failed = [r for r in results if r.failure is not None]
    if not results:
        raise MeshtronError("--max-minutes passed before any proxy run finished: raise it, "
                            "or give --law")
    if not done:
        raise MeshtronError(f"every proxy run failed (the first, "
                            f"{failed[0].proxy.shape.describe()}: {failed[0].failure})")
    try:
        fit = fit_law([p for r in done for p in r.points])
    except MeshtronError as err:
        first = f"; the first failure: {failed[0].failure}" if failed else ""
        raise MeshtronError(f"{len(done)} of {len(results)} proxy runs finished, too few for "
                            f"the fit: {err}{first}") from None
    return fit, f"{len(done)} proxy runs" + (f", {len(failed)} failed" if failed else "")


def second_round(cfg: Config, s: ProxySettings, budget: Budget, law: ScalingLaw,
                 priced: list[Priced], results: list[ProxyResult]) -> list[Proxy]:
    """The ``refine`` shapes the law ranks best, each twice as long as the first round."""
    ranked = sorted(priced, key=lambda p: law.loss(p.sizes.law, p.tokens))
    chosen: list[Proxy] = []
    for p in ranked:
        if len(chosen) >= s.refine:
            break
        proxy = proxy_of(cfg, s, budget, p.shape, 2.0)
        before = next((r.proxy for r in results if r.proxy.shape == p.shape), None)
        if isinstance(proxy, Proxy) and (before is None or proxy.steps > before.steps):
            chosen.append(proxy)
    return chosen


def fitted_law(cfg: Config, s: ProxySettings, budget: Budget, space: ShapeSpace,
               priced: list[Priced], law_text: str | None, deadline: Deadline | None = None
               ) -> tuple[ScalingLaw, Fit | None, str, list[ProxyResult]]:
    """The law and, when fitted, the fit, where it came from and every proxy's result (one
    per shape: a refined shape's longer run)."""
    if law_text:
        return parse_law(law_text), None, f"--law {law_text}", []
    check_settings(s, budget)
    proxies = first_round(cfg, s, budget, space)
    deadline = deadline or Deadline(s.max_minutes)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    print(plan_line(proxies, tokens), file=sys.stderr, flush=True)
    with scratch_dir(cfg.data.cache_dir, "archsearch-") as scratch:
        folder = Path(s.folder) if s.folder else Path(scratch)
        results = run_proxies(cfg, proxies, folder, s.nproc, s.points, s.timeout_s,
                              deadline=deadline)
        fit, source = fit_results(results)
        refine = second_round(cfg, s, budget, fit.law, priced, results) \
            if s.refine and budget.cluster is None and not deadline.passed() else []
        if refine:
            print(f"refining: {len(refine)} shape{'s' if len(refine) > 1 else ''} the first "
                  "law ranks best, trained twice as far; " + plan_line(refine, tokens, "refine"),
                  file=sys.stderr, flush=True)
            again = run_proxies(cfg, refine, folder, s.nproc, s.points, s.timeout_s,
                                label="refine", deadline=deadline)
            longer = {r.proxy.shape: r for r in again if r.failure is None}
            results = [longer.pop(r.proxy.shape, r) for r in results] + list(longer.values())
            results += [r for r in again if r.failure is not None]
            fit, source = fit_results(results)
            source += f", {len(refine)} refined"
    return fit.law, fit, source, [dataclasses.replace(r, run_dir=r.run_dir if s.folder
                                                      else None) for r in results]
