"""The cost model inside a training run: what ``train.autotune`` holds the running plan to.

The online tuner (:mod:`meshtron.training.autotune`) asks two prices of planned configs on the
job's ranks of ``train.autotune_profile``: the predicted step time of a micro-batch size it may
switch to (at the running layout), and, for ``train.autotune=layout``, the layouts of the same
ranks ranked by the search of ``meshtron tune``.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.config import Config
from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.estimate import Estimator
from meshtron.costmodel.problem import Cluster, problem_of
from meshtron.costmodel.profiles import load_profile
from meshtron.costmodel.search import Pins, search
from meshtron.plan import plan_run

Overrides = dict[str, object]
"""A layout as config fields (``parallel.tp``, ``train.micro_batch``, ...)."""


def candidate_of(cfg: Config, world_size: int) -> Candidate:
    """The layout a config runs, as the tuner names it (the plan's micro-batch where
    ``train.micro_batch`` is unset)."""
    p, t = cfg.parallel, cfg.train
    plan = plan_run(cfg, world_size)
    return Candidate(p.tp, p.cp, p.pp, p.vpp, p.schedule, p.ep, p.etp, plan.dp, p.zero, p.sp,
                     plan.micro_batch, t.recompute)


@dataclass(frozen=True)
class RunningPrices:
    """The cost model's prices of planned configs on a running job's ranks."""

    cluster: Cluster
    world_size: int

    def step_time(self, planned: Config) -> float:
        """Predicted seconds per step."""
        estimator = Estimator(problem_of(planned, self.cluster))
        return estimator.estimate(candidate_of(planned, self.world_size)).step_time_s

    def layouts(self, planned: Config) -> list[tuple[Overrides, float]]:
        """The layouts of the same ranks and batch that fit, fastest first, with their times."""
        ranked = search(problem_of(planned, self.cluster), Pins(), planned).ranked
        return [(e.candidate.overrides(), e.step_time_s) for e in ranked if e.fits]


def running_prices(cfg: Config, world_size: int) -> RunningPrices | None:
    """The prices on ``world_size`` ranks of the profile, or None when ``train.autotune`` is off
    or names no profile (a bad profile is refused with one line: the command checks this
    before any process starts)."""
    t = cfg.train
    if t.autotune == "off" or not t.autotune_profile:
        return None
    return RunningPrices(Cluster(load_profile(t.autotune_profile), world_size), world_size)
