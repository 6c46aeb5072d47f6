"""``meshtron tune --trial K``: run the best candidates through the real trainer and learn from it.

A cost model is only as good as its last check against the machine, so the tuner checks
itself: each of the top ``K`` fitting candidates trains for a few steps as a separate
``meshtron train --nproc N`` (the same code path a user runs, so nothing is re-implemented
here), its ``metrics.jsonl`` gives the measured step time (the median after the first, warm-up
step) and peak memory (the largest ``mem_peak_bytes``), and the winner is chosen by
measurement. The median ratio of measured to predicted is folded into the profile's
``time_correction`` and ``memory_correction`` (written back when the profile is a file), so the
next plan starts from what this machine did.

Memory is compared as the trainer measures it: rank 0's peak, which on CUDA is
``max_memory_allocated`` (tensors only) and on a CPU is the process's ``ru_maxrss`` (its whole
resident set: interpreter, torch, data, allocator slack). The profile's
``memory_reserved_bytes`` is what that measure holds besides the model (calibrated as the RSS of
a process that has imported the trainer), so the correction is fitted on the memory above it:
(measured - reserved) / (predicted - reserved).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from meshtron.config import Config
from meshtron.costmodel.priced import Estimate
from meshtron.costmodel.profiles import ClusterProfile, builtin_profiles, load_profile, save_profile
from meshtron.costmodel.search import apply
from meshtron.data.cache import scratch as scratch_dir
from meshtron.errors import MeshtronError
from meshtron.training.metrics import read_metrics

JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "MESHTRON_LAUNCHER_PID", "MESHTRON_LAUNCH_ATTEMPT")
"""A rank's environment: a trial must start its own group, not join the tuner's job."""
START_S = 300.0
"""Seconds a trial may take besides its steps: start-up (imports, tokenizer, data), the plan,
the final checkpoint."""
SLACK = 20.0
"""A trial is stopped after START_S + SLACK x the predicted time of its steps."""


@dataclass(frozen=True)
class Measurement:
    step_time_s: float
    """Median step time over the steps after the first (which warms caches and allocators)."""
    memory_bytes: int
    """Rank 0's largest ``mem_peak_bytes`` over the run."""
    step_times_s: tuple[float, ...] = ()
    """Every step's time, the first included (for reports)."""


@dataclass(frozen=True)
class Trial:
    estimate: Estimate
    run_dir: Path
    measured: Measurement | None
    failure: str | None = None
    """Why the run gave no measurement, in one line (None when it did)."""


def check_trial_arguments(k: int, nproc: int, steps: int, ranked: list[Estimate]) -> None:
    """Refuse trials that cannot measure what was planned, before any run starts."""
    if k < 1:
        raise MeshtronError(f"--trial must be at least 1 (candidates to run), got {k}")
    if steps < 2:
        raise MeshtronError(f"--trial-steps must be at least 2 (the first step is warm-up "
                            f"and not timed), got {steps}")
    world = ranked[0].candidate.world_size
    if nproc != world:
        raise MeshtronError(f"--trial runs each candidate on the planned world size: --nproc "
                            f"{nproc} must equal --cluster.gpus={world}")


def trial_config(cfg: Config, estimate: Estimate, steps: int, run_dir: Path) -> Config:
    """The candidate's config for a short, quiet run: every step logged, no evaluation, no
    checkpoint before the end (the trainer always saves the last step, after its metrics),
    no straggler checks or plot."""
    chosen = apply(cfg, estimate.candidate)
    return dataclasses.replace(
        chosen,
        train=dataclasses.replace(chosen.train, steps=steps, log_every=1, eval_every=0,
                                  eval_generate=0),
        checkpoint=dataclasses.replace(chosen.checkpoint, dir=None, every=0,
                                       every_seconds=0.0, keep_last=1, async_=False),
        run=dataclasses.replace(chosen.run, dir=str(run_dir), progress=False, plot=False,
                                straggler_every=0, wandb="off"))


def trial_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without a rank's job variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local ranks only: no hostname lookups
    return {**env, **(extra or {})}


def last_line(text: str) -> str:
    """The line that says why a run stopped: the last non-empty one of its output."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def start_trial(config_path: Path, nproc: int, log_path: Path, timeout_s: float,
                env: Mapping[str, str] | None = None) -> str | None:
    """Run ``meshtron train`` on the config; None on success, else why not. The run gets a
    session of its own, which is stopped whole (the launcher; its ranks die with it) when it
    takes too long or this process is interrupted: a terminal's Ctrl-C reaches only the
    foreground session."""
    command = [sys.executable, "-m", "meshtron", "train", "--config", str(config_path),
               "--nproc", str(nproc)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env=trial_environment(env), start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            return f"stopped after {timeout_s:.0f} s (see {log_path})"
        except BaseException:
            stop(proc)
            raise
    if code != 0:
        return f"exit {code}: {last_line(log_path.read_text(errors='replace'))}"
    return None


def stop(proc: subprocess.Popen) -> None:
    """Kill the trial's session and reap its launcher."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def measure(run_dir: Path, steps: int) -> Measurement:
    """Step time and memory from the run's ``metrics.jsonl``."""
    rows = [r for r in read_metrics(run_dir) if isinstance(r.get("step"), int)
            and "step_time_s" in r]
    timed = [r["step_time_s"] for r in rows if r["step"] > 1]
    if not timed:
        raise MeshtronError(f"{run_dir / 'metrics.jsonl'} has no step after the first "
                            f"({len(rows)} rows of {steps} steps)")
    return Measurement(statistics.median(timed), max(int(r["mem_peak_bytes"]) for r in rows),
                       tuple(r["step_time_s"] for r in rows))


def run_trial(cfg: Config, estimate: Estimate, index: int, nproc: int, steps: int,
              folder: Path, env: Mapping[str, str] | None = None) -> Trial:
    """One candidate: write its config, train it (``env`` added to its environment), read
    its measurements."""
    run_dir = folder / str(index)
    config_path = folder / f"{index}.yaml"
    trial_config(cfg, estimate, steps, run_dir).save(config_path)
    timeout = START_S + SLACK * steps * estimate.step_time_s
    failure = start_trial(config_path, nproc, folder / f"{index}.log", timeout, env)
    if failure is None:
        try:
            return Trial(estimate, run_dir, measure(run_dir, steps))
        except MeshtronError as err:
            failure = str(err)
    return Trial(estimate, run_dir, None, failure)


def error(predicted: float, measured: float) -> float:
    """Signed relative error of a prediction: + means it predicted more than was measured."""
    return predicted / measured - 1.0 if measured > 0 else float("nan")


def trial_table(trials: list[Trial], reserved: float) -> list[str]:
    """Predicted against measured, one row per trial, in the order they ran."""
    gib = 2**30
    lines = [f"{'layout':<46} {'pred s':>8} {'meas s':>8} {'error':>7} {'pred GiB':>9} "
             f"{'meas GiB':>9} {'error':>7}"]
    for t in trials:
        e = t.estimate
        head = f"{e.candidate.describe():<46} {e.step_time_s:>8.4g}"
        if t.measured is None:
            lines.append(f"{head} {'failed':>8}")
            continue
        m = t.measured
        lines.append(f"{head} {m.step_time_s:>8.4g} {error(e.step_time_s, m.step_time_s):>+7.1%}"
                     f" {e.memory.peak / gib:>9.3f} {m.memory_bytes / gib:>9.3f} "
                     f"{error(e.memory.peak, m.memory_bytes):>+7.1%}")
    lines.append(f"(error = predicted / measured - 1; memory: rank 0's peak, of which the "
                 f"profile reserves {reserved / 2**20:,.0f} MiB for the runtime)")
    return lines


def folded(profile: ClusterProfile, trials: list[Trial]) -> ClusterProfile:
    """The profile with the median measured-over-predicted ratios folded into its
    corrections (the predictions already include the old corrections, hence the product).
    Memory is fitted above the reserved bytes, which the correction does not scale."""
    done = [t for t in trials if t.measured is not None]
    time_ratio = statistics.median(t.measured.step_time_s / t.estimate.step_time_s
                                   for t in done)
    memory = [(t.measured.memory_bytes - t.estimate.memory.reserved)
              / (t.estimate.memory.peak - t.estimate.memory.reserved)
              for t in done if t.measured.memory_bytes > t.estimate.memory.reserved
              and t.estimate.memory.peak > t.estimate.memory.reserved]
    memory_ratio = statistics.median(memory) if memory else 1.0
    return dataclasses.replace(profile, time_correction=profile.time_correction * time_ratio,
                               memory_correction=profile.memory_correction * memory_ratio)


def write_back(source: str | None, new: ClusterProfile) -> str:
    """Save the corrections into the profile file they came from (re-read, so only the two
    corrections change: not the command line's gpus_per_node); say what happened."""
    if source is None or source in builtin_profiles():
        return (f"the built-in profile {new.name} is not written; keep these corrections by "
                "calibrating a profile file (meshtron tune --calibrate)")
    path = Path(source)
    updated = dataclasses.replace(load_profile(source), time_correction=new.time_correction,
                                  memory_correction=new.memory_correction)
    save_profile(updated, path)
    return f"wrote the corrections into {path}"


def by_measurement(ranked: list[Estimate], trials: list[Trial]) -> list[Estimate]:
    """The measured candidates, fastest measured first, then the rest as ranked (fitting
    first, by predicted time): the winner is the first."""
    measured = sorted((t for t in trials if t.measured is not None),
                      key=lambda t: t.measured.step_time_s)
    first = [t.estimate for t in measured]
    rest = [e for e in ranked if all(e is not f for f in first)]
    return sorted(first + rest, key=lambda e: not e.fits)  # stable: keeps the order above


def run_trials(cfg: Config, ranked: list[Estimate], k: int, nproc: int, steps: int,
               profile: ClusterProfile, trial_dir: Path | None,
               profile_source: str | None = None) -> list[Estimate]:
    """Run the top ``k`` fitting candidates for ``steps`` steps each on ``nproc`` local
    ranks, print predicted against measured, fold the error into the profile (written back
    to ``profile_source`` when it is a file) and return the candidates re-sorted by
    measurement."""
    check_trial_arguments(k, nproc, steps, ranked)
    chosen = [e for e in ranked if e.fits][:k]
    with scratch_dir(cfg.data.cache_dir, "trials-") as scratch:
        folder = trial_dir or Path(scratch)
        prepare(folder, len(chosen))
        trials = []
        for i, estimate in enumerate(chosen, 1):
            print(f"trial {i}/{len(chosen)}: {estimate.candidate.describe()} for {steps} "
                  f"steps on {nproc} rank{'s' if nproc > 1 else ''}", file=sys.stderr,
                  flush=True)
            trial = run_trial(cfg, estimate, i, nproc, steps, folder)
            if trial.failure:
                print(f"trial {i} ({estimate.candidate.describe()}) failed: {trial.failure}",
                      file=sys.stderr, flush=True)
            trials.append(trial)
    return report(ranked, trials, profile, profile_source)


def prepare(folder: Path, count: int) -> None:
    """The trial folder exists and holds no earlier trial (whose checkpoint a new run would
    resume from, measuring nothing)."""
    folder.mkdir(parents=True, exist_ok=True)
    taken = [str(i) for i in range(1, count + 1) if (folder / str(i)).exists()]
    if taken:
        raise MeshtronError(f"--trial-dir {folder} already holds trial runs ({', '.join(taken)})"
                            "; give a new or empty folder")


def report(ranked: list[Estimate], trials: list[Trial], profile: ClusterProfile,
           profile_source: str | None) -> list[Estimate]:
    """The table, the winner, the folded corrections; every trial failing is an error."""
    if all(t.measured is None for t in trials):
        raise MeshtronError(f"every trial run failed (the first: {trials[0].failure})")
    print(f"trial runs, {len(trials)} candidates through meshtron train:")
    print("\n".join(trial_table(trials, profile.memory_reserved_bytes)))
    result = by_measurement(ranked, trials)
    best = next(t for t in trials if t.estimate is result[0])
    predicted_best = trials[0].estimate
    same = "also the predicted best" if best.estimate is predicted_best else (
        f"the prediction ranked {predicted_best.candidate.describe()} first")
    print(f"winner by measurement: {best.estimate.candidate.describe()} at "
          f"{best.measured.step_time_s:.4g} s/step ({same})")
    new = folded(profile, trials)
    print(f"folded into the profile: time_correction {profile.time_correction:.4g} -> "
          f"{new.time_correction:.4g}, memory_correction {profile.memory_correction:.4g} -> "
          f"{new.memory_correction:.4g}; {write_back(profile_source, new)}")
    return result

