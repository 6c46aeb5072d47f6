"""The cost model inside a training run: what ``train.autotune`` holds the running plan to.

The trainer lives below the tuner (it must not import it), so the command line builds this
price and hands it down: a function of a planned config (a micro-batch size the retuner may
switch to, at the running layout) to the predicted step time on ``train.autotune_profile``.
"""

from __future__ import annotations

from meshtron.config import Config
from meshtron.training.autotune import Predict
from meshtron.tuning.candidate import Candidate
from meshtron.tuning.estimate import Estimator
from meshtron.tuning.profiles import load_profile
from meshtron.tuning.tune_command import Cluster, problem_of


def candidate_of(cfg: Config, world_size: int) -> Candidate:
    """The layout a planned config runs, as the tuner names it."""
    p, t = cfg.parallel, cfg.train
    dp = world_size // (p.tp * p.cp * p.pp)
    return Candidate(p.tp, p.cp, p.pp, p.vpp, p.schedule, p.ep, p.etp, dp, p.zero, p.sp,
                     t.micro_batch or t.global_batch // dp, t.recompute)


def running_plan_price(cfg: Config, world_size: int) -> Predict | None:
    """The predicted step time of a planned config on ``world_size`` ranks of the profile, or
    None when ``train.autotune`` is off or names no profile (a bad profile is refused here,
    with one line, before the run starts)."""
    t = cfg.train
    if t.autotune == "off" or not t.autotune_profile:
        return None
    cluster = Cluster(load_profile(t.autotune_profile), world_size)

    def predict(planned: Config) -> float:
        estimator = Estimator(problem_of(planned, cluster))
        return estimator.estimate(candidate_of(planned, world_size)).step_time_s

    return predict
