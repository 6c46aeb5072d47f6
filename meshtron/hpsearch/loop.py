"""The hpsearch loop: ask Optuna for a trial, run it at every proxy width, tell the result.

The first width's study drives the search (its sampler proposes); every other width replays
the same parameters in its own study (its own pruner, comparing trials of that width only), so
the per-width curves are measured at the same points. The loop is safe to interrupt at any
moment: on resume, trials left running are marked failed and run again, and a width that had
not yet replayed a finished trial of the first does so first.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from meshtron.errors import MeshtronError
from meshtron.hpsearch.proxies import WidthProxy
from meshtron.hpsearch.ranking import Row
from meshtron.hpsearch.space import Dimension, format_value
from meshtron.hpsearch.study import (
    STATUS,
    SearchSettings,
    done,
    fixed,
    held,
    open_study,
    recover,
    storage_of,
    tell,
)
from meshtron.hpsearch.watch import Outcome, Reporter, run_watched
from meshtron.tune.deadline import Deadline


class Search:
    """The studies of one search (one per width) and how to run their trials."""

    def __init__(self, runs: Sequence[WidthProxy], dims: Sequence[Dimension], trials: int,
                 args: argparse.Namespace, grid: Mapping[str, Sequence[Any]] | None,
                 deadline: Deadline | None = None):
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.runs, self.trials = list(runs), trials
        self.nproc, self.timeout_s = args.nproc, args.trial_timeout
        self.study_path = args.study
        self.deadline = deadline or Deadline(getattr(args, "max_minutes", None))
        """``--max-minutes``: no trial starts after it, a running one gets what is left."""
        t, factor = runs[0].base.train, args.reduction_factor
        settings = SearchSettings(args.sampler, args.pruner, args.seed, factor,
                                  args.min_steps or first_rung(t.steps, t.warmup_steps, factor),
                                  t.steps, grid)
        points = args.grid_points if grid is not None else None
        self.distributions = {d.name: d.distribution(points) for d in dims}
        space = [d.describe() for d in dims]
        record_base = {"space": space, "sampler": args.sampler,
                       **({"grid_points": args.grid_points} if grid is not None else {}),
                       "pruner": {"kind": args.pruner, "reduction_factor": factor,
                                  "first_rung": settings.min_units}}
        where = f"--study {args.study}"
        self.storage = storage_of(Path(args.study) if args.study else None)
        self.studies = [open_study(self.storage, study_name(p), settings,
                                   {**record_base, "proxy": p.fingerprint()}, where,
                                   replay=i > 0)
                        for i, p in enumerate(self.runs)]

    def run(self, folder: Path) -> None:
        """Run trials until the first width's study holds ``trials`` finished ones."""
        with held(Path(self.study_path) if self.study_path else None):
            self._search(folder)

    def _search(self, folder: Path) -> None:
        self._resume()
        driver, proxy = self.studies[0], self.runs[0]
        self._catch_up(folder)
        while len(done(driver)) < self.trials:
            if self.deadline.passed():
                print(f"hpsearch: --max-minutes {self.deadline.minutes:g} reached after "
                      f"{len(done(driver))} of {self.trials} trials; the table holds what "
                      "finished", file=sys.stderr, flush=True)
                return
            trial = driver.ask(self.distributions)
            self._run(driver, proxy, trial, folder)
            for study, other in zip(self.studies[1:], self.runs[1:]):
                self._replay(study, other, trial.number, trial.params, folder)

    def _resume(self) -> None:
        """Say what the study file already holds; fail what an interruption left running."""
        if self.study_path is None:
            return
        held = len(done(self.studies[0]))
        left = sum(len(recover(self.storage, s, rerun=i == 0))
                   for i, s in enumerate(self.studies))
        if not held and not left:
            return
        rest = max(0, self.trials - held)
        each = f" (at the first of {len(self.studies)} widths)" if len(self.studies) > 1 else ""
        line = (f"resuming from {self.study_path}: {held} trial{'s' if held != 1 else ''} "
                f"already done{each}")
        if left:
            line += (f", {left} left running by an interruption (marked failed, its parameters "
                     "run again)")
        line += (f"; {rest} more to reach --trials {self.trials}" if rest else
                 f"; nothing more to run for --trials {self.trials}")
        print(line, file=sys.stderr, flush=True)

    def _catch_up(self, folder: Path) -> None:
        """Replay, at each other width, the first width's finished trials it lacks."""
        first = done(self.studies[0])
        for study, proxy in zip(self.studies[1:], self.runs[1:]):
            have = {t.user_attrs.get("source") for t in done(study)}
            for t in first:
                if t.number not in have:
                    self._replay(study, proxy, t.number, t.params, folder)

    def _replay(self, study: optuna.Study, proxy: WidthProxy, source: int,
                params: Mapping[str, Any], folder: Path) -> None:
        with fixed(study, params):
            trial = study.ask(self.distributions)
        trial.set_user_attr("source", source)
        self._run(study, proxy, trial, folder)

    def _run(self, study: optuna.Study, proxy: WidthProxy, trial: optuna.Trial,
             folder: Path) -> None:
        """One trial: its config, its run (pruned by the study's pruner), its result told."""
        here = folder / study.study_name
        here.mkdir(parents=True, exist_ok=True)
        run_dir, config_path = here / str(trial.number), here / f"{trial.number}.yaml"
        started, planned = time.monotonic(), None
        try:
            cfg = proxy.trial_config(trial.params, run_dir)
        except MeshtronError as err:
            outcome = Outcome("failed", None, 0, f"refused: {err}")
        else:
            planned = cfg.train.steps
            if run_dir.exists():
                shutil.rmtree(run_dir)  # an earlier search's run: it would be resumed
            cfg.save(config_path)
            batch = cfg.train.global_batch
            reporter = Reporter(trial, lambda step: proxy.units(step, batch))
            outcome = run_watched(config_path, run_dir, here / f"{trial.number}.log",
                                  self.nproc, reporter,
                                  self.deadline.timeout(self.timeout_s))
            shutil.rmtree(cfg.checkpoint_dir, ignore_errors=True)  # no trial is resumed
        seconds = round(time.monotonic() - started, 2)
        for key, value in (("width", proxy.width), ("steps", outcome.steps),
                           ("planned_steps", planned), ("error", outcome.error),
                           ("seconds", seconds)):
            trial.set_user_attr(key, value)
        if outcome.status == "complete":
            tell(study, trial, values=outcome.loss)
        else:
            tell(study, trial, state=TrialState.PRUNED if outcome.status == "pruned"
                 else TrialState.FAIL)
        print(progress_line(trial.number, proxy, trial.params, outcome, planned, seconds),
              file=sys.stderr, flush=True)

    def rows(self) -> list[Row]:
        """Every trial the studies hold, as reported."""
        return [row_of(t, p.width) for s, p in zip(self.studies, self.runs)
                for t in s.get_trials(deepcopy=False)
                if t.state not in (TrialState.WAITING, TrialState.RUNNING)]


def first_rung(steps: int, warmup: int, factor: int) -> int:
    """The pruner's first rung: the budget over ``factor`` squared (successive halving's usual
    start, three rungs), and not inside the warm-up (while the rates still ramp up, a larger
    one always looks better) unless the warm-up is most of the run."""
    return max(1, math.ceil(steps / factor**2), min(warmup, steps // factor))


def study_name(proxy: WidthProxy) -> str:
    return f"hpsearch-width-{proxy.width}" if proxy.width else "hpsearch"


def row_of(t: FrozenTrial, width: int | None) -> Row:
    a = t.user_attrs
    loss = t.value if t.state in (TrialState.COMPLETE, TrialState.PRUNED) else None
    return Row(t.number, width, dict(t.params), loss, STATUS[t.state], a.get("steps"),
               a.get("planned_steps"), a.get("error"), a.get("seconds"))


def progress_line(number: int, proxy: WidthProxy, params: Mapping[str, Any], outcome: Outcome,
                  planned: int | None, seconds: float) -> str:
    at = f" at width {proxy.width}" if proxy.width else ""
    text = ", ".join(f"{k}={format_value(v)}" for k, v in params.items())
    steps = f"{outcome.steps}/{planned if planned is not None else '-'} steps, {seconds:.1f} s"
    if outcome.status == "failed":
        return f"trial {number}{at}: {text} -> failed ({steps}): {outcome.error}"
    return f"trial {number}{at}: {text} -> {outcome.status}, loss {outcome.loss:.4f} ({steps})"
