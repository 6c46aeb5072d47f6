"""The cost model inside a training run: what ``train.autotune`` holds the running plan to.

The trainer lives below the tuner (it must not import it), so the command line builds these
prices and hands them down: the predicted step time of a planned config (a micro-batch size
the retuner may switch to, at the running layout) on ``train.autotune_profile``, and, for
``train.autotune=layout``, the layouts of the same ranks ranked by the search of
``meshtron tune``.
"""

from __future__ import annotations

from meshtron.config import Config
from meshtron.plan import plan_run
from meshtron.training.autotune import CostModel, Overrides
from meshtron.tuning.candidate import Candidate
from meshtron.tuning.estimate import Estimator
from meshtron.tuning.problem import Cluster, problem_of
from meshtron.tuning.profiles import load_profile
from meshtron.tuning.search import Pins, search


def candidate_of(cfg: Config, world_size: int) -> Candidate:
    """The layout a config runs, as the tuner names it (the plan's micro-batch where
    ``train.micro_batch`` is unset)."""
    p, t = cfg.parallel, cfg.train
    plan = plan_run(cfg, world_size)
    return Candidate(p.tp, p.cp, p.pp, p.vpp, p.schedule, p.ep, p.etp, plan.dp, p.zero, p.sp,
                     plan.micro_batch, t.recompute)


def running_plan_cost(cfg: Config, world_size: int) -> CostModel | None:
    """The tuner's prices on ``world_size`` ranks of the profile, or None when
    ``train.autotune`` is off or names no profile (a bad profile is refused here, with one
    line, before the run starts)."""
    t = cfg.train
    if t.autotune == "off" or not t.autotune_profile:
        return None
    cluster = Cluster(load_profile(t.autotune_profile), world_size)

    def step_time(planned: Config) -> float:
        estimator = Estimator(problem_of(planned, cluster))
        return estimator.estimate(candidate_of(planned, world_size)).step_time_s

    def layouts(planned: Config) -> list[tuple[Overrides, float]]:
        ranked = search(problem_of(planned, cluster), Pins(), planned).ranked
        return [(e.candidate.overrides(), e.step_time_s) for e in ranked if e.fits]

    return CostModel(step_time, layouts)
