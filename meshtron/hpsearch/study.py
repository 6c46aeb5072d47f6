"""The Optuna side of hpsearch: studies (one per proxy width), samplers, pruners, resuming.

A study file is Optuna's journal (``JournalStorage`` on a file: an append-only log a person
can read, no database). Each width has its own study in it, so the pruner compares a trial
only with trials of the same width. A study records the space and the proxy's settings it was
run with; resuming with different ones is refused, since its old losses would not compare. A
trial an interruption left running is marked failed (its user attribute ``interrupted``) and
its parameters are queued to run again.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from meshtron.errors import MeshtronError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, so one search per file is on the user
    fcntl = None  # type: ignore[assignment]

STATUS = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned",
          TrialState.FAIL: "failed", TrialState.RUNNING: "running",
          TrialState.WAITING: "waiting"}


@dataclass(frozen=True)
class SearchSettings:
    sampler: str
    """``tpe``, ``random`` or ``grid``."""
    pruner: str
    """``sha`` (successive halving), ``hyperband`` or ``none``."""
    seed: int
    reduction_factor: int
    min_units: int
    max_units: int
    grid: Mapping[str, Sequence[Any]] | None = None
    """The grid's values per dimension (``sampler == "grid"``)."""


def make_sampler(s: SearchSettings) -> optuna.samplers.BaseSampler:
    if s.sampler == "grid":
        return optuna.samplers.GridSampler({k: list(v) for k, v in s.grid.items()}, seed=s.seed)
    if s.sampler == "random":
        return optuna.samplers.RandomSampler(seed=s.seed)
    return optuna.samplers.TPESampler(seed=s.seed)


def make_pruner(s: SearchSettings) -> optuna.pruners.BasePruner:
    if s.pruner == "none":
        return optuna.pruners.NopPruner()
    if s.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=s.min_units, max_resource=s.max_units,
                                              reduction_factor=s.reduction_factor)
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=s.min_units,
                                                  reduction_factor=s.reduction_factor)


def storage_of(path: Path | None) -> optuna.storages.BaseStorage:
    """The journal in ``path`` (created when new), or memory for a search without a file."""
    if path is None:
        return optuna.storages.InMemoryStorage()
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    if path.exists() and not path.is_file():
        raise MeshtronError(f"--study {path} is not a file")
    try:
        return JournalStorage(JournalFileBackend(str(path)))
    except Exception as err:  # a file that is not a journal: Optuna's own error, in one line
        raise MeshtronError(f"--study {path} is not a readable Optuna journal "
                            f"({type(err).__name__}: {err})") from None


def open_study(storage: optuna.storages.BaseStorage, name: str, s: SearchSettings,
               record: Mapping[str, Any], where: str, replay: bool = False) -> optuna.Study:
    """Create the study ``name``, or load it when the file holds it, refusing one that was
    run with another ``record`` (the space, the proxy's settings). A ``replay`` study only
    runs parameters another study chose (see :func:`fixed`), so it samples nothing itself."""
    sampler = optuna.samplers.RandomSampler(seed=s.seed) if replay else make_sampler(s)
    pruner = make_pruner(s)
    record = json.loads(json.dumps(record))  # as the journal gives it back
    try:
        try:
            study = optuna.load_study(study_name=name, storage=storage, sampler=sampler,
                                      pruner=pruner)
        except KeyError:  # not in the file yet
            study = optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                        pruner=pruner, direction="minimize")
            for key, value in record.items():
                study.set_user_attr(key, value)
            return study
    except Exception as err:  # a damaged journal or another file: Optuna's error, one line
        raise MeshtronError(f"{where} is not a readable Optuna journal "
                            f"({type(err).__name__}: {err})") from None
    for key, value in record.items():
        old = study.user_attrs.get(key)
        if old != value:
            raise MeshtronError(f"{where} was run with other settings "
                                f"({difference(old, value, key + '.')}); give the same ones, "
                                "or a new --study file")
    return study


def difference(old: Any, new: Any, prefix: str = "") -> str:
    """The first place two records differ, as ``name: old -> new``."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in list(old) + [k for k in new if k not in old]:
            if old.get(key) != new.get(key):
                return difference(old.get(key), new.get(key), f"{prefix}{key}.")
    return f"{prefix.rstrip('.') or 'value'}: {old!r} -> {new!r}"


def recover(storage: optuna.storages.BaseStorage, study: optuna.Study, rerun: bool
            ) -> list[FrozenTrial]:
    """Mark the trials an interruption left running as failed (user attribute
    ``interrupted``); with ``rerun``, queue each again through Optuna's own retry of a stale
    trial (a waiting trial with the same parameters and, under the grid sampler, the same grid
    point). Safe because the search holds the study file (:func:`held`): a trial running here
    belongs to no live search. Returns the trials marked."""
    left = study.get_trials(deepcopy=True, states=(TrialState.RUNNING,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=None)
    study_id = storage.get_study_id_from_name(study.study_name)
    for t in left:
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(trial_id, "interrupted", True)
        storage.set_trial_user_attr(trial_id, "error", "interrupted; its parameters run again")
        tell(study, t.number, state=TrialState.FAIL)
        if rerun:
            retry(study, t)  # copies t as it was: without the two attributes just set
    return left


def tell(study: optuna.Study, trial: Any, **kwargs: Any) -> None:
    """``study.tell``, tolerating GridSampler's ``study.stop()`` after the grid's last point:
    outside ``study.optimize`` it raises, after the trial was stored (optuna#5141)."""
    grid = isinstance(study.sampler, optuna.samplers.GridSampler)
    try:
        study.tell(trial, **kwargs)
    except RuntimeError as err:
        if not (grid and "Study.stop" in str(err)):
            raise


def done(study: optuna.Study) -> list[FrozenTrial]:
    """Trials that ran to an end (complete, pruned or failed by themselves), in order."""
    return [t for t in study.get_trials(deepcopy=False)
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
            and not t.user_attrs.get("interrupted")]


@contextlib.contextmanager
def held(path: Path | None) -> Iterator[None]:
    """One search at a time per study file: an advisory ``flock`` on the journal itself for
    the search's duration (the kernel drops it however the process ends). Optuna's own lock
    guards single writes, not which trials a live search is running."""
    if path is None or fcntl is None:
        yield
        return
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MeshtronError(f"--study {path} is in use by another hpsearch; wait for it "
                                "to end, or give another --study file") from None
        yield


@contextlib.contextmanager
def fixed(study: optuna.Study, params: Mapping[str, Any]) -> Iterator[optuna.Study]:
    """The study asking exactly ``params`` (a width replaying another width's trial)."""
    base = study.sampler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.sampler = optuna.samplers.PartialFixedSampler(dict(params), base)
    try:
        yield study
    finally:
        study.sampler = base
