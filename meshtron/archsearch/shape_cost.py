"""What a budget buys each shape: tokens, optimizer steps and memory, with or without a cluster.

Without a cluster the budget is FLOPs and a shape sees D = budget / (its training FLOPs per
token, ``models/flops.py``); its memory is the cost model's bytes for one process of the
config's own layout (parameters, gradients, optimizer state, activations, logits), as the
trainer would hold them on ``--nproc`` ranks. On a cluster the budget is time: ``--budget-flops``
taken at the cluster's peak (seconds = FLOPs / (GPUs x peak FLOP/s of the dtype)) or
``--budget-gpu-hours``, and a shape sees D = seconds x the tokens/s of its best layout, found by
``meshtron tune``'s search (exact memory pruning included). A shape that runs at a higher MFU on
that cluster so sees more tokens for the same money.

A cluster search costs about a second a shape, so the command first bounds every shape cheaply
(tokens at 100% MFU, the state bytes of ZeRO-3 over every GPU) and runs the search only on the
shapes the law ranks best (:meth:`Pricer.bound`, :meth:`Pricer.cluster`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from meshtron.archsearch.shapes import Shape, Sizes, shape_config, sizes_of
from meshtron.config import Config, validate
from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.estimate import Estimator
from meshtron.costmodel.memory_model import StageParams, state_bytes, with_vocab
from meshtron.costmodel.priced import Estimate
from meshtron.costmodel.problem import Cluster, Problem, problem_of
from meshtron.costmodel.profiles import ClusterProfile, Link
from meshtron.costmodel.search import Pins, search
from meshtron.errors import MeshtronError
from meshtron.models.flops import model_size, training_flops_per_token
from meshtron.plan import check_model, check_run

MIN_STEPS = 10
"""Optimizer steps a budget must buy a shape (and more than its warm-up): fewer is no run."""
SIMULATE = 8
"""Layouts per shape priced with the schedule simulator (``meshtron tune`` uses 48)."""


@dataclass(frozen=True)
class Budget:
    flops: float
    """Model FLOPs the budget stands for (on a cluster: its time at the peak)."""
    seconds: float | None = None
    """Time on the cluster; None without one."""
    cluster: Cluster | None = None

    def describe(self) -> str:
        if self.cluster is None:
            return f"{self.flops:.3g} FLOPs"
        c = self.cluster
        return (f"{self.seconds / 3600:,.4g} h on {c.gpus} x {c.profile.name} "
                f"({self.seconds * c.gpus / 3600:,.4g} GPU-hours, {self.flops:.3g} FLOPs at peak)")


MAX_BUDGET_FLOPS = 1e30
"""About 10^4 times the largest training runs published: a budget past it is a typo, refused
before the grid is sized for it or a proxy is started."""


def budget_of(flops: float | None, gpu_hours: float | None, cluster: Cluster | None,
              dtype: str) -> Budget:
    """The budget from ``--budget-flops`` or ``--budget-gpu-hours``, checked."""
    if flops is not None and gpu_hours is not None:
        raise MeshtronError("give only one of --budget-flops and --budget-gpu-hours (the "
                            "other follows from the cluster's peak FLOP/s)")
    if flops is None and gpu_hours is None:
        raise MeshtronError("archsearch needs a budget: give --budget-flops F"
                            + (" or --budget-gpu-hours H" if cluster else ""))
    value = flops if flops is not None else gpu_hours
    name = "--budget-flops" if flops is not None else "--budget-gpu-hours"
    if not (math.isfinite(value) and value > 0):
        raise MeshtronError(f"{name} must be a positive number, got {value}")
    if flops is not None and flops > MAX_BUDGET_FLOPS:
        raise MeshtronError(f"--budget-flops {flops:g} is beyond any training run (at most "
                            f"{MAX_BUDGET_FLOPS:g}): a typo?")
    if cluster is None:
        if gpu_hours is not None:
            raise MeshtronError("--budget-gpu-hours needs a cluster (--cluster.gpu=NAME "
                                "--cluster.gpus=N); without one give --budget-flops")
        return Budget(value)
    peak = cluster.gpus * cluster.profile.peak(dtype)
    seconds = value / peak if flops is not None else value * 3600 / cluster.gpus
    if seconds * peak > MAX_BUDGET_FLOPS:
        raise MeshtronError(f"{name} {value:g} buys {seconds * peak:.3g} FLOPs on "
                            f"{cluster.gpus} x {cluster.profile.name}, beyond any training run "
                            f"(at most {MAX_BUDGET_FLOPS:g}): a typo?")
    return Budget(seconds * peak, seconds, cluster)


@dataclass
class Priced:
    """One shape under the budget."""

    shape: Shape
    sizes: Sizes
    params: int
    """Every parameter (embeddings included)."""
    flops_per_token: float
    tokens: float
    steps: int
    memory_bytes: float
    fits: bool
    estimate: Estimate | None = None
    """The best layout on the cluster (None without one, or before the search)."""
    exact: bool = True
    """False for a cluster bound (tokens at peak, memory at its floor) not yet searched."""
    loss: float = math.nan
    """Predicted by the law (set once it is fitted)."""

    def row(self) -> dict:
        """The JSON entry of a priced shape."""
        out = {**self.shape.overrides(), "params": self.params,
               "non_embedding_params": self.sizes.total, "active_params": self.sizes.active,
               "law_params": self.sizes.law, "flops_per_token": self.flops_per_token,
               "tokens": self.tokens, "steps": self.steps, "memory_bytes": self.memory_bytes,
               "fits": self.fits, "predicted_loss": self.loss}
        if self.estimate is not None:
            e = self.estimate
            out.update(layout=e.candidate.describe(), tokens_per_s=e.tokens_per_s, mfu=e.mfu,
                       step_time_s=e.step_time_s)
        return out


def host_memory() -> float:
    """Physical memory of this machine (the default limit without a cluster)."""
    try:
        return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 16e9


def host_profile(memory_bytes: float, ranks: int) -> ClusterProfile:
    """A stand-in profile for the memory model without a cluster: only the limit is read."""
    return ClusterProfile(
        name="this host", source="no cluster: the bytes of one process", gpus_per_node=ranks,
        memory_bytes=int(memory_bytes), memory_bandwidth=1.0,
        peak_flops=dict.fromkeys(("fp32", "bf16", "fp16", "fp64"), 1.0),
        intra_node=Link(1.0, 0.0), inter_node=Link(1.0, 0.0))


class Pricer:
    """Prices shapes of one base config under one budget and memory limit per rank."""

    def __init__(self, cfg: Config, budget: Budget, memory_limit: float | None, nproc: int,
                 pins: Pins | None = None):
        self.cfg, self.budget, self.nproc, self.pins = cfg, budget, nproc, pins or Pins()
        cluster = budget.cluster
        if cluster is not None and memory_limit is not None:
            profile = dataclasses.replace(cluster.profile, memory_bytes=int(memory_limit))
            cluster = Cluster(profile, cluster.gpus)
        self.cluster = cluster
        self.limit = (cluster.profile.memory_bytes if cluster else
                      memory_limit if memory_limit is not None else host_memory() / nproc)
        self.tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        self.min_steps = max(MIN_STEPS, cfg.train.warmup_steps + 1)
        self._searched: dict[Shape, Priced] = {}

    def config(self, shape: Shape) -> Config:
        """The shape's config, vocabulary resolved; raises MeshtronError when the config or
        (without a cluster) the plan of the config's layout refuses it."""
        cfg = shape_config(self.cfg, shape)
        cfg = dataclasses.replace(cfg, model=with_vocab(cfg.model, cfg.data.vocab_size))
        validate(cfg)
        check_model(cfg)
        if self.cluster is None:
            check_run(cfg, self.nproc)
        return cfg

    def _base(self, shape: Shape, cfg: Config) -> tuple[Sizes, int, float]:
        m = cfg.model
        return sizes_of(m), model_size(m).params, training_flops_per_token(m, cfg.train.seq_len)

    def local(self, shape: Shape) -> Priced:
        """Exact without a cluster: D from the FLOPs, memory of one rank of the config's
        layout."""
        cfg = self.config(shape)
        sizes, params, fpt = self._base(shape, cfg)
        tokens = self.budget.flops / fpt
        memory = local_memory(cfg, self.nproc, self.limit)
        return Priced(shape, sizes, params, fpt, tokens, int(tokens // self.tokens_per_step),
                      memory, memory <= self.limit)

    def bound(self, shape: Shape) -> Priced:
        """On a cluster, before the search: tokens at 100% MFU (no layout does better) and
        the state bytes of ZeRO-3 over every GPU (no layout holds less)."""
        cfg = self.config(shape)
        sizes, params, fpt = self._base(shape, cfg)
        tokens = self.budget.flops / fpt
        problem = problem_of(cfg, self.cluster)
        floor = state_floor(params, problem)
        return Priced(shape, sizes, params, fpt, tokens, int(tokens // self.tokens_per_step),
                      floor, floor <= problem.memory_limit, exact=False)

    def searched(self, shape: Shape) -> Priced:
        """On a cluster: the best layout of ``meshtron tune``'s search; D from its tokens/s."""
        if shape in self._searched:
            return self._searched[shape]
        cfg = self.config(shape)
        sizes, params, fpt = self._base(shape, cfg)
        problem = problem_of(cfg, self.cluster)
        ranked = search(problem, self.pins, cfg, simulate=SIMULATE).ranked
        if not ranked:
            priced = Priced(shape, sizes, params, fpt, 0.0, 0, math.inf, False)
        else:
            best = ranked[0]
            tokens = self.budget.seconds * best.tokens_per_s
            priced = Priced(shape, sizes, params, fpt, tokens,
                            int(tokens // self.tokens_per_step), best.memory.peak, best.fits,
                            best)
        self._searched[shape] = priced
        return priced

    def first_pass(self, shape: Shape) -> Priced:
        return self.local(shape) if self.cluster is None else self.bound(shape)


def local_memory(cfg: Config, nproc: int, limit: float) -> float:
    """Peak bytes of one rank of the config's layout on ``nproc`` ranks (the cost model's
    memory, no runtime reserve)."""
    p, t = cfg.parallel, cfg.train
    dp = nproc // (p.tp * p.cp * p.pp)
    micro = t.micro_batch or t.global_batch // dp
    candidate = Candidate(p.tp, p.cp, p.pp, p.vpp, p.schedule, p.ep, p.etp, dp, p.zero,
                          p.sp, micro, t.recompute)
    problem = Problem(cfg.model, t.seq_len, t.global_batch, host_profile(limit, nproc), nproc,
                      dtype=cfg.precision.dtype, fp8=cfg.precision.fp8 != "none",
                      reduce_dtype=cfg.precision.reduce_dtype, cp_comm=p.cp_comm)
    return Estimator(problem).memory(candidate).peak


def state_floor(params: int, problem: Problem) -> float:
    """The least persistent memory any layout of ``problem`` can have per GPU: every
    parameter's state under ZeRO-3 spread over all GPUs, plus the profile's reserve."""
    gpus = problem.gpus
    whole = Candidate(1, 1, 1, 1, "1f1b", 1, None, gpus, 3 if gpus > 1 else 0, False, 1,
                      "full")
    state = state_bytes(StageParams(params, 0, 0), whole, problem.element_size,
                        problem.reduce_size)
    return sum(state.values()) * problem.profile.memory_correction \
        + problem.reserved_bytes
