"""What ``meshtron archsearch`` reports: the Pareto front, the table, the plot, the JSON and the
chosen model as a config.

The front is defined at the given budget: every shape is trained on the whole budget, and its
cost is its training FLOPs per token (6 x the weights a token meets plus attention, three times
what serving a token costs, so the axis is also the price of inference). A shape is on the front
when no shape is both cheaper per token and predicted lower in loss; the chosen shape, the lowest
predicted loss, is the front's most expensive point, and the others say what a cheaper model
costs in loss for the same training budget.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import yaml

from meshtron.archsearch.proxy_runs import ProxyResult
from meshtron.archsearch.scaling_law import Fit, ScalingLaw
from meshtron.archsearch.shape_cost import Budget, Priced
from meshtron.archsearch.shapes import shape_config
from meshtron.config import Config
from meshtron.costmodel.search import apply


def pareto_front(priced: Sequence[Priced]) -> list[Priced]:
    """The shapes no other beats in both FLOPs per token and predicted loss, cheapest first."""
    front: list[Priced] = []
    for p in sorted(priced, key=lambda p: (p.flops_per_token, p.loss)):
        if not front or p.loss < front[-1].loss:
            front.append(p)
    return front


def best(priced: Sequence[Priced]) -> Priced:
    """The lowest predicted loss; a tie goes to the cheaper shape per token."""
    return min(priced, key=lambda p: (p.loss, p.flops_per_token))


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def table(rows: Sequence[Priced], cluster: bool, mark: Sequence[Priced] = ()) -> list[str]:
    """One line per shape: sizes, cost, what the budget buys, memory, predicted loss."""
    head = (f"{'#':>3} {'shape':<36} {'N law':>7} {'params':>7} {'FLOP/tok':>9} "
            f"{'tokens':>8} {'steps':>8} ")
    head += (f"{'layout':<44} {'tok/s':>9} {'MFU':>6} {'GiB/GPU':>8} " if cluster
             else f"{'GiB':>7} ")
    lines = [head + f"{'pred loss':>9}"]
    for i, p in enumerate(rows, 1):
        line = (f"{i:>3} {p.shape.describe():<36} {_count(p.sizes.law):>7} "
                f"{_count(p.params):>7} {_count(p.flops_per_token):>9} {_count(p.tokens):>8} "
                f"{p.steps:>8,} ")
        gib = p.memory_bytes / 2**30
        if cluster:
            e = p.estimate
            layout = e.candidate.describe() if e else "(not searched)"
            rate = f"{e.tokens_per_s:>9,.0f} {e.mfu:>6.1%}" if e else f"{'':>9} {'':>6}"
            line += f"{layout:<44} {rate} {gib:>8.1f} "
        else:
            line += f"{gib:>7.3f} "
        line += f"{p.loss:>9.4f}" + (" *" if any(p is m for m in mark) else "")
        lines.append(line)
    return lines


def fit_lines(fit: Fit | None, law: ScalingLaw, source: str) -> list[str]:
    """The law and how well it fits, in words."""
    text = (f"scaling law ({source}): L(N, D) = {law.E:.4g} + {law.A:.4g} / N^{law.alpha:.3f} "
            f"+ {law.B:.4g} / D^{law.beta:.3f}")
    lines = [text]
    if fit is not None:
        line = (f"fit: {len(fit.residuals)} points, rms log-residual {fit.rms:.4f}, "
                f"largest {fit.max_abs:.4f}")
        if fit.holdout:
            errors = sorted(abs(v) for v in fit.holdout.values())
            line += (f"; leave-one-proxy-out error of the last point: median "
                     f"{errors[len(errors) // 2]:.2%}, largest {errors[-1]:.2%}")
        lines.append(line)
        lines += [f"warning: {w}" for w in fit.warnings]
    return lines


def payload(budget: Budget, chosen: Priced, front: Sequence[Priced], priced: Sequence[Priced],
            law: ScalingLaw, fit: Fit | None, source: str, proxies: Sequence[ProxyResult],
            counts: dict[str, float]) -> dict:
    """The ``--json`` document: ``chosen`` (the model fields) and ``front`` are the contract."""
    cluster = budget.cluster
    where = None if cluster is None else {
        "gpu": cluster.profile.name, "gpus": cluster.gpus,
        "gpus_per_node": cluster.profile.gpus_per_node, "source": cluster.profile.source}
    fit_part = fit.summary() if fit is not None else {"law": law.as_dict()}
    return {
        "chosen": chosen.shape.overrides(),
        "front": [p.row() for p in front],
        "prediction": chosen.row(),
        "budget": {"flops": budget.flops, "seconds": budget.seconds,
                   "gpu_hours": None if cluster is None else
                   budget.seconds * cluster.gpus / 3600, "cluster": where},
        "fit": {**fit_part, "source": source},
        "proxies": [{"shape": r.proxy.shape.describe(), **r.proxy.shape.overrides(),
                     "law_params": r.proxy.n, "steps": r.proxy.steps, "reused": r.reused,
                     "failure": r.failure, "run_dir": str(r.run_dir) if r.run_dir else None,
                     "points": [{"tokens": p.d, "loss": p.loss} for p in r.points]}
                    for r in proxies],
        "shapes": [p.row() for p in sorted(priced, key=lambda p: p.loss)],
        "counts": counts,
    }


def write_config(cfg: Config, chosen: Priced, path: Path, budget: Budget) -> Path:
    """The chosen model as a config ``meshtron train --config`` runs: the base config with the
    shape, ``train.steps`` for the budget and, on a cluster, the shape's best layout."""
    out = shape_config(cfg, chosen.shape)
    out = dataclasses.replace(out, train=dataclasses.replace(out.train,
                                                             steps=max(1, chosen.steps)))
    ranks = "--nproc N"
    if chosen.estimate is not None:
        out = apply(out, chosen.estimate.candidate)
        ranks = f"--nproc {budget.cluster.gpus}"
    header = (f"# meshtron archsearch: {chosen.shape.describe()}, predicted loss "
              f"{chosen.loss:.4f} after {chosen.tokens:.4g} tokens ({budget.describe()})\n"
              f"# run it: meshtron train --config {path.name} {ranks}\n")
    path.write_text(header + yaml.safe_dump(out.to_dict(), sort_keys=False))
    return path


def plot(path: Path, priced: Sequence[Priced], front: Sequence[Priced], chosen: Priced,
         law: ScalingLaw, proxies: Sequence[ProxyResult]) -> Path:
    """Left: predicted loss against FLOPs per token, the front drawn and the choice marked.
    Right (with proxy runs): their losses against tokens and the fitted law through them, out
    to the chosen shape's point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in proxies if r.points]
    fig, axes = plt.subplots(1, 2 if runs else 1, figsize=(13 if runs else 7, 5), squeeze=False)
    ax = axes[0][0]
    ax.scatter([p.flops_per_token for p in priced], [p.loss for p in priced], s=12,
               color="0.7", label="shapes (whole budget)")
    ax.plot([p.flops_per_token for p in front], [p.loss for p in front], "o-", color="C0",
            label="Pareto front")
    for p in front:
        ax.annotate(p.shape.describe().split(" ")[0], (p.flops_per_token, p.loss), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    ax.plot([chosen.flops_per_token], [chosen.loss], "*", color="C3", markersize=14,
            label=f"chosen: {chosen.shape.describe()}")
    ax.set_xscale("log")
    ax.set(xlabel="training FLOPs per token", ylabel="predicted loss",
           title="predicted loss vs cost at the budget")
    ax.legend(fontsize=8)
    if runs:
        ax = axes[0][1]
        for i, r in enumerate(runs):
            color = f"C{i % 10}"
            ds = [p.d for p in r.points]
            ax.plot(ds, [p.loss for p in r.points], "o", color=color, markersize=4,
                    label=r.proxy.shape.describe())
            grid = [ds[0] * (ds[-1] / ds[0]) ** (k / 20) for k in range(21)]
            ax.plot(grid, [law.loss(r.proxy.n, d) for d in grid], "-", color=color, lw=1)
        lo = min(p.d for r in runs for p in r.points)
        hi = max(chosen.tokens, lo * 2)
        grid = [lo * (hi / lo) ** (k / 40) for k in range(41)]
        ax.plot(grid, [law.loss(chosen.sizes.law, d) for d in grid], "--", color="C3", lw=1)
        ax.plot([chosen.tokens], [chosen.loss], "*", color="C3", markersize=14,
                label="chosen at the budget")
        ax.set_xscale("log")
        ax.set(xlabel="training tokens D", ylabel="validation loss",
               title="proxy runs and the fitted L(N, D)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finite(priced: Sequence[Priced]) -> list[Priced]:
    return [p for p in priced if math.isfinite(p.loss)]
