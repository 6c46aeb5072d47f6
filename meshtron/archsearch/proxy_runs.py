"""Proxy runs: short real trainings of a few shapes, whose losses the scaling law is fitted to.

Each proxy is a separate ``meshtron train --config F --nproc N`` (the runner of ``meshtron tune
--trial``, :mod:`meshtron.tune.trials`), so what is fitted is what the trainer does. A proxy
trains at a constant learning rate after the config's warm-up (``train.min_lr`` = ``train.lr``)
and is evaluated every ``steps / points`` steps: with no decay to come, its validation loss at
step s is that of a constant-rate run of s steps, so one run gives several points (N, D, L) of
the law (the first quarter of the run and twice the warm-up are left out). A run that anneals
(the config's cosine, as the chosen model trains) ends lower by a gain close to a constant
fraction of the loss; scaling E, A and B by one factor moves no argmin, so the choice stands
(the absolute predicted loss is that of a constant-rate run: docs/archsearch.md says by how
much the benchmark's trained losses differ).

Proxies are chosen log-spaced in N across the shapes, so the fit sees the whole range it
predicts over. Each run lives in ``<proxy dir>/<shape>-<hash of its config>``: a rerun with
the same ``--proxy-dir`` reuses every finished run. A run that fails is reported with its last
line and the fit goes on with the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from meshtron.archsearch.scaling_law import Point
from meshtron.archsearch.shapes import Shape, shape_config
from meshtron.config import Config, ParallelConfig
from meshtron.training.metrics import read_metrics
from meshtron.tune.deadline import Deadline
from meshtron.tune.trials import start_trial


@dataclass(frozen=True)
class Proxy:
    shape: Shape
    n: float
    """The law's N of the shape."""
    steps: int
    flops_per_token: float = 0.0
    """Training FLOPs per token of the shape (what the run costs, for the report)."""


@dataclass(frozen=True)
class ProxyResult:
    proxy: Proxy
    points: tuple[Point, ...]
    failure: str | None = None
    reused: bool = False
    run_dir: Path | None = None


FLOPS_PER_S = 3e9
"""What a proxy run trains at on this machine's 2 cores, for the estimate said before the
runs start (measured from the README's example); the progress lines then use the rate the
finished proxies measured."""
START_S = 15.0
"""A proxy run's start-up (the interpreter, torch, the data) beside its training."""


def proxy_cost(proxy: Proxy, tokens_per_step: int) -> float:
    """The proxy's training FLOPs (its last step's)."""
    return proxy.steps * tokens_per_step * proxy.flops_per_token


def plan_line(proxies: list[Proxy], tokens_per_step: int, label: str = "proxy") -> str:
    """The runs about to start, what they cost and about how long they take here."""
    flops = sum(proxy_cost(p, tokens_per_step) for p in proxies)
    seconds = flops / FLOPS_PER_S + START_S * len(proxies)
    shapes = ", ".join(f"{p.shape.describe()} x {p.steps}" for p in proxies)
    return (f"planned: {len(proxies)} {label} runs ({shapes} steps), {flops:.3g} FLOPs, "
            f"about {seconds / 60:.1f} min on 2 idle cores (--max-minutes bounds it)")


def progress_line(name: str, done: list[tuple[float, float]], rest: list[Proxy],
                  tokens_per_step: int) -> str:
    """After a run: its time, and the time the others should take at the measured rate."""
    flops, seconds = (sum(x) for x in zip(*done))
    rate = max(flops, 1.0) / max(seconds - START_S * len(done), 1e-3)
    left = sum(proxy_cost(p, tokens_per_step) / rate + START_S for p in rest)
    return (f"{name}: done in {done[-1][1]:.0f} s; " + (f"about {left / 60:.1f} min left for "
            f"the other {len(rest)}" if rest else "the last"))


def choose(candidates: list[Proxy], count: int) -> list[Proxy]:
    """``count`` proxies log-spaced in N from the smallest to the largest candidate (for one N,
    the first given)."""
    by_n: dict[float, Proxy] = {}
    for p in sorted(candidates, key=lambda p: p.n):
        by_n.setdefault(p.n, p)
    sizes = list(by_n.values())
    if count >= len(sizes):
        return sizes
    if count == 1:
        return [sizes[len(sizes) // 2]]
    lo, hi = math.log(sizes[0].n), math.log(sizes[-1].n)
    chosen: list[Proxy] = []
    for i in range(count):
        target = lo + (hi - lo) * i / (count - 1)
        rest = [p for p in sizes if p not in chosen]
        chosen.append(min(rest, key=lambda p: abs(math.log(p.n) - target)))
    return sorted(chosen, key=lambda p: p.n)


def proxy_config(cfg: Config, proxy: Proxy, points: int, run_dir: Path) -> Config:
    """The proxy's run: the shape on one data-parallel layout, a constant learning rate after
    the warm-up, ``points`` evaluations, no checkpoint before the end, quiet (a nominal
    ``peak_flops`` skips the CPU's start-up matmul probe: a proxy's MFU is not read)."""
    chosen = shape_config(cfg, proxy.shape)
    every = max(1, proxy.steps // points)
    return dataclasses.replace(
        chosen, parallel=ParallelConfig(),
        train=dataclasses.replace(chosen.train, steps=proxy.steps, min_lr=chosen.train.lr,
                                  eval_every=every, log_every=every, eval_generate=0,
                                  micro_batch=None, recompute="none",
                                  peak_flops=chosen.train.peak_flops or 1e12),
        checkpoint=dataclasses.replace(chosen.checkpoint, dir=None, every=0, every_seconds=0.0,
                                       keep_last=1, async_=False, resume=True,
                                       resume_from=None),
        run=dataclasses.replace(chosen.run, dir=str(run_dir), progress=False, plot=False,
                                straggler_every=0, wandb="off"))


def run_key(cfg: Config) -> str:
    """What makes two proxy runs one run: the whole config but where it is written and how far
    it goes (at a constant learning rate a longer run continues a shorter one exactly)."""
    data = cfg.to_dict()
    data["run"] = {k: v for k, v in data["run"].items() if k != "dir"}
    data["train"] = {k: v for k, v in data["train"].items()
                     if k not in ("steps", "eval_every", "log_every")}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:10]


def points_of(run_dir: Path, proxy: Proxy, tokens_per_step: int, warmup: int) -> list[Point]:
    """The validation losses after the first quarter of the run and twice the warm-up (the
    loss right after the warm-up still falls faster than any power law of D)."""
    first = max(proxy.steps / 4, 2 * warmup)
    rows = [r for r in read_metrics(run_dir) if isinstance(r.get("step"), int)
            and isinstance(r.get("val_loss"), (int, float)) and r["step"] >= first]
    label = proxy.shape.describe()
    return [Point(proxy.n, float(r["step"] * tokens_per_step), float(r["val_loss"]), label)
            for r in sorted(rows, key=lambda r: r["step"])]


def finished(run_dir: Path, steps: int) -> bool:
    """The run has evaluated at ``steps`` or beyond."""
    if not (run_dir / "metrics.jsonl").is_file():
        return False
    return any(isinstance(r.get("step"), int) and r["step"] >= steps and "val_loss" in r
               for r in read_metrics(run_dir))


def resumable(run_dir: Path) -> bool:
    """A complete checkpoint is there (a shorter run of the same proxy): the trainer goes on
    from it. Without one, whatever is there is a crashed run, started again from scratch."""
    return any((run_dir / "checkpoints").glob("step_*"))


def run_proxies(cfg: Config, proxies: list[Proxy], folder: Path, nproc: int, points: int,
                timeout_s: float, label: str = "proxy", deadline: Deadline | None = None
                ) -> list[ProxyResult]:
    """Train, extend or reuse every proxy until ``deadline``; each result has its points or
    its failure (the proxies not started by then have none)."""
    folder.mkdir(parents=True, exist_ok=True)
    deadline = deadline or Deadline(None)
    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    results: list[ProxyResult] = []
    timed: list[tuple[float, float]] = []
    for i, proxy in enumerate(proxies, 1):
        if deadline.passed():
            say(f"--max-minutes {deadline.minutes:g} reached: {i - 1} of {len(proxies)} "
                f"{label} runs done, the fit uses what finished")
            break
        started = deadline.clock()
        probe = proxy_config(cfg, proxy, points, folder)
        run_dir = folder / f"{proxy.shape.slug()}-{run_key(probe)}"
        run_cfg = proxy_config(cfg, proxy, points, run_dir)
        name = f"{label} {i}/{len(proxies)} ({proxy.shape.describe()}, {proxy.steps} steps)"
        reused = finished(run_dir, proxy.steps)
        failure = None
        if reused:
            say(f"{name}: reusing {run_dir}")
        else:
            extend = resumable(run_dir)
            if run_dir.exists() and not extend:
                shutil.rmtree(run_dir)
            config_path = run_dir.with_suffix(".yaml")
            run_cfg.save(config_path)
            say(f"{name}: {'extending' if extend else 'training'} {run_dir}")
            failure = start_trial(config_path, nproc, run_dir.with_suffix(".log"),
                                  deadline.timeout(timeout_s))
        found: list[Point] = []
        if failure is None:
            found = points_of(run_dir, proxy, tokens_per_step, cfg.train.warmup_steps)
            if not found:
                failure = f"no validation loss after step {proxy.steps // 4} in {run_dir}"
        if failure:
            say(f"{name} failed: {failure}; the fit goes on without it")
        results.append(ProxyResult(proxy, tuple(found), failure, reused, run_dir))
        if not reused and failure is None:
            timed.append((proxy_cost(proxy, tokens_per_step), deadline.clock() - started))
            say(progress_line(name, timed, proxies[i:], tokens_per_step))
    return results


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
