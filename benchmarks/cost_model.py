"""The tuner's cost model against the real trainer on this machine: predicted vs measured step
time and peak memory per rank for layouts of the tiny and small models on 1-4 processes.

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/cost_model.py [--json OUT] [--profile F]

(``--calibrate-nproc``, ``--quick``, ``--steps``, ``--configs NAME ...``, ``--exact-allocator``:
see ``--help``.)

**Calibration.** First this machine is calibrated as a user does it, ``meshtron tune
--calibrate --nproc N --output F`` with N = ``--calibrate-nproc`` (4: the largest world below),
full unless ``--quick``; ``--profile F`` uses an existing profile file instead. The profile's
trial corrections are reset to 1: the benchmark checks the model, not its feedback.

**Prediction.** For each layout, the config a user would give (``--model.preset``,
``--train.global_batch``, ``--train.seq_len``, fp32) and the layout as a :class:`Candidate`
are priced by :class:`meshtron.costmodel.estimate.Estimator` on the ``Problem`` that ``meshtron
tune`` builds (:func:`meshtron.tune.tune_command.problem_of`) with the world size as the
cluster's GPU count; each layout passes the trainer's plan checks first.

**Measurement.** The same run through the real trainer, by the runner of ``meshtron tune
--trial`` (:func:`meshtron.tune.trials.run_trial`): ``meshtron train --config F --nproc N``
for ``--steps`` steps, every step logged, no evaluation, a checkpoint only after the last
step's metrics. Step time = median of the trainer's ``step_time_s`` (rank 0's wall time of one
``train_step``) over the steps after the first; memory = the largest ``mem_peak_bytes``: on a
CPU rank 0's ``ru_maxrss``, the whole process's resident peak, which the model covers with the
profile's ``memory_reserved_bytes`` (the RSS of a process that has imported the trainer). With
``--exact-allocator`` the runs get ``MALLOC_MMAP_THRESHOLD_=65536`` (``harness.EXACT_ALLOCATOR``:
RSS follows live tensors instead of the heap glibc keeps), which separates the model's error
from the allocator's retention. For a pipeline, rank 0 is stage 0, so its prediction is stage
0's (:meth:`Estimator.memory` gives the peak over stages for planning). Error = predicted /
measured - 1. Goals: time within +-15%, memory within +-10%.

**After trials.** What ``--trial`` would make of each layout: its prediction times the median
measured/predicted ratio of the other layouts of the same model (memory: above the reserved
bytes), the corrections trial runs of those fold into the profile. Blank for a model with one
layout here.

**Other people's load.** With 2 cores, 4 processes share them (each rank gets half a core, as
the cost model assumes), and other jobs on the same cores distort a run. Before each run (and
the calibration) the script waits up to ``--quiet-wait`` s for the machine to be idle (under
15% busy over a second); during it, other jobs' share = the machine's busy CPU time
(``/proc/stat``) minus this process's and its waited-for children's (``getrusage``), over all
CPU time. A run above 15% is repeated (``--attempts`` in all) and the least disturbed kept;
the table's last column is its share.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import harness

from meshtron.config import Config, load_config
from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.estimate import Estimator
from meshtron.costmodel.priced import Estimate
from meshtron.costmodel.profiles import load_profile, profile_to_dict, save_profile
from meshtron.costmodel.search import runnable
from meshtron.tune.trials import Trial, error, run_trial
from meshtron.tune.tune_command import Cluster, problem_of

T = TypeVar("T")
GOAL_TIME, GOAL_MEMORY = 0.15, 0.10
QUIET = 0.15
"""A machine less busy than this (share of all cores, measured while the script sleeps) is
taken as free of other people's jobs."""


@dataclass(frozen=True)
class Layout:
    name: str
    preset: str
    candidate: Candidate
    batch: int
    seq: int

    @property
    def world(self) -> int:
        return self.candidate.world_size

    def overrides(self) -> list[str]:
        return [f"--model.preset={self.preset}", f"--train.global_batch={self.batch}",
                f"--train.seq_len={self.seq}", "--precision.dtype=fp32"]


def layout(name: str, preset: str, world: int, mb: int, *, tp: int = 1, cp: int = 1,
           pp: int = 1, vpp: int = 1, schedule: str = "1f1b", ep: int = 1, zero: int = 0,
           batch: int = 8, seq: int = 256) -> Layout:
    dp = world // (tp * cp * pp)
    return Layout(name, preset, Candidate(tp, cp, pp, vpp, schedule, ep, None, dp, zero, tp > 1,
                                          mb, "none"), batch, seq)


LAYOUTS = (
    layout("tiny-1", "tiny", 1, 4),
    layout("tiny-tp2", "tiny", 2, 4, tp=2),
    layout("tiny-pp2-1f1b", "tiny", 2, 2, pp=2),
    layout("tiny-pp2-zbh1", "tiny", 2, 2, pp=2, schedule="zb-h1"),
    layout("tiny-pp2-interleaved", "tiny", 2, 2, pp=2, vpp=2, schedule="interleaved"),
    layout("tiny-dp2-zero1", "tiny", 2, 4, zero=1),
    layout("tiny-dp2-zero3", "tiny", 2, 4, zero=3),
    layout("tiny-moe-ep2", "tiny-moe", 2, 4, ep=2),
    layout("tiny-long-cp2", "tiny-long", 2, 1, cp=2, batch=2, seq=2048),
    layout("tiny-tp2-dp2", "tiny", 4, 2, tp=2, zero=1),
    layout("tiny-pp2-dp2", "tiny", 4, 2, pp=2, zero=1),
    layout("tiny-tp4", "tiny", 4, 8, tp=4),
    layout("small-1", "small", 1, 2, batch=2, seq=128),
    layout("small-tp2", "small", 2, 2, tp=2, batch=2, seq=128),
    layout("small-dp2-zero1", "small", 2, 1, zero=1, batch=2, seq=128),
)


def cpu_ticks() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from ``/proc/stat`` (steal, the
    time a hypervisor gave to other machines, counts as busy: it is someone else's too)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields) - idle) / hz, sum(fields) / hz


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of every child it has waited for (a trial's launcher
    waits for its ranks, so their time is in it once the trial is over)."""
    me, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                          resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def others_share(work: Callable[[], T]) -> tuple[T, float]:
    """``work()`` and the share of the machine's CPU time that other people's jobs took while
    it ran: the machine's busy time minus this process's and its children's."""
    busy0, total0 = cpu_ticks()
    own0 = own_cpu_seconds()
    result = work()
    busy1, total1 = cpu_ticks()
    others = (busy1 - busy0) - (own_cpu_seconds() - own0)
    return result, max(0.0, others / max(1e-9, total1 - total0))


def wait_for_quiet(limit_s: float) -> float:
    """Wait up to ``limit_s`` for other jobs on these cores to pause (less than QUIET of the
    CPU busy over a second, while this script sleeps); the busy share last seen."""
    deadline = time.monotonic() + limit_s
    while True:
        _, busy = others_share(lambda: time.sleep(1.0))
        if busy <= QUIET or time.monotonic() >= deadline:
            return busy
        time.sleep(4.0)


def calibrate(nproc: int, quick: bool, output: Path) -> None:
    """``meshtron tune --calibrate`` on ``nproc`` ranks, as a user runs it."""
    command = [sys.executable, "-m", "meshtron", "tune", "--calibrate", "--nproc", str(nproc),
               "--output", str(output), *(["--quick"] if quick else [])]
    print("calibrating: meshtron", " ".join(command[3:]), flush=True)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"calibration failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print(done.stdout, flush=True)


def stage0_memory(estimator: Estimator, c: Candidate) -> float:
    """Rank 0's predicted peak: stage 0's when pipelined (the trainer measures rank 0)."""
    if c.pp == 1:
        return estimator.memory(c).peak
    return estimator.memory(c, stage=0).peak


def measure_layout(cfg: Config, estimate: Estimate, world: int, steps: int, folder: Path,
                   env: dict[str, str] | None, quiet_s: float,
                   attempts: int) -> tuple[Trial, list[float]]:
    """The trainer's run of one layout, after waiting for quiet; run again (up to
    ``attempts`` in all) while other jobs took more than QUIET of the CPU during it. The run
    they disturbed least, and every attempt's share of others' load."""
    runs: list[tuple[float, Trial]] = []
    for attempt in range(attempts):
        wait_for_quiet(quiet_s)
        trial, share = others_share(lambda a=attempt: run_trial(
            cfg, estimate, a, world, steps, folder, env))
        runs.append((share, trial))
        if share <= QUIET or trial.measured is None:
            break
    share, trial = min(runs, key=lambda run: run[0])
    return trial, [run[0] for run in runs]


def run_layout(item: Layout, profile_path: Path, steps: int, folder: Path,
               env: dict[str, str] | None, quiet_s: float, attempts: int) -> dict[str, Any]:
    """Predict and measure one layout; a row of the report."""
    cfg = load_config(None, item.overrides())
    c = item.candidate
    cluster = Cluster(load_profile(str(profile_path)), item.world)
    if not runnable(cfg, c, item.world):
        raise SystemExit(f"{item.name}: the trainer's plan refuses {c.describe()}")
    estimator = Estimator(problem_of(cfg, cluster))
    estimate = estimator.estimate(c)
    (folder / item.name).mkdir()
    trial, shares = measure_layout(cfg, estimate, item.world, steps, folder / item.name, env,
                                   quiet_s, attempts)
    row: dict[str, Any] = {
        "name": item.name, "preset": item.preset, "layout": c.describe(), "procs": item.world,
        "global_batch": item.batch, "seq_len": item.seq,
        "predicted_s": estimate.step_time_s, "predicted_bytes": stage0_memory(estimator, c),
        "predicted_peak_over_stages_bytes": estimate.memory.peak,
        "breakdown_s": estimate.breakdown, "memory_parts": dataclasses.asdict(estimate.memory),
        "others_cpu_share": shares, "run_dir": str(trial.run_dir), "failure": trial.failure}
    if trial.measured is not None:
        m = trial.measured
        row.update(measured_s=m.step_time_s, measured_bytes=m.memory_bytes,
                   step_times_s=m.step_times_s,
                   time_error=error(estimate.step_time_s, m.step_time_s),
                   memory_error=error(row["predicted_bytes"], m.memory_bytes))
    return row


def fold_others(rows: list[dict[str, Any]], reserved: float) -> None:
    """What ``--trial`` would give each layout: its prediction times the median
    measured/predicted ratio of the *other* layouts of the same model (time; memory above the
    reserved bytes), the corrections that trial runs of those fold into the profile (trials
    run one model's candidates). Adds ``folded_*`` to the rows of models with two or more."""
    done = [r for r in rows if "measured_s" in r]
    for row in done:
        others = [r for r in done if r is not row and r["preset"] == row["preset"]]
        if not others:
            continue
        time_ratio = statistics.median(r["measured_s"] / r["predicted_s"] for r in others)
        memory_ratio = statistics.median((r["measured_bytes"] - reserved)
                                         / (r["predicted_bytes"] - reserved) for r in others)
        folded_s = row["predicted_s"] * time_ratio
        folded_bytes = reserved + (row["predicted_bytes"] - reserved) * memory_ratio
        row.update(folded_time_correction=time_ratio, folded_memory_correction=memory_ratio,
                   folded_time_error=error(folded_s, row["measured_s"]),
                   folded_memory_error=error(folded_bytes, row["measured_bytes"]))


def cells(row: dict[str, Any]) -> list[str]:
    mib = 2**20
    head = [row["name"], row["layout"], str(row["procs"]), f"{row['predicted_s']:.3f}"]
    others = f"{min(row['others_cpu_share']):.0%}"
    if "measured_s" not in row:
        return head + ["failed", "", f"{row['predicted_bytes'] / mib:,.0f}", "", "", "", "",
                       others]
    folded = [f"{row[k]:+.1%}" if k in row else ""
              for k in ("folded_time_error", "folded_memory_error")]
    return head + [f"{row['measured_s']:.3f}", f"{row['time_error']:+.1%}",
                   f"{row['predicted_bytes'] / mib:,.0f}", f"{row['measured_bytes'] / mib:,.0f}",
                   f"{row['memory_error']:+.1%}", *folded, others]


HEADER = ("layout", "split", "procs", "predicted s", "measured s", "error", "predicted MiB",
          "measured MiB", "error", "time error after trials", "memory error after trials",
          "others' load")


def within(rows: list[dict[str, Any]], key: str, goal: float) -> int:
    return sum(abs(r[key]) <= goal for r in rows if key in r)


def summary(rows: list[dict[str, Any]]) -> str:
    done = [r for r in rows if "measured_s" in r]
    return (f"{len(done)} of {len(rows)} layouts measured; within the goals (time +-15%, "
            f"memory +-10%): calibrated profile {within(done, 'time_error', GOAL_TIME)} and "
            f"{within(done, 'memory_error', GOAL_MEMORY)}, after the other layouts' trial "
            f"corrections {within(done, 'folded_time_error', GOAL_TIME)} and "
            f"{within(done, 'folded_memory_error', GOAL_MEMORY)}")


def main() -> None:
    parser = harness.cli.parser(
        __doc__, harness.cli.steps(8, "trainer steps per layout (the first is warm-up)"),
        harness.cli.configs([item.name for item in LAYOUTS]),
        harness.cli.switch("--quick", "quick calibration (fewer, shorter probes)"),
        harness.cli.switch("--exact-allocator",
                           "run the trainer with MALLOC_MMAP_THRESHOLD_=65536"))
    parser.add_argument("--profile", type=Path, help="use this profile instead of calibrating")
    parser.add_argument("--calibrate-nproc", type=int, default=4,
                        help="ranks of the calibration (default 4)")
    parser.add_argument("--quiet-wait", type=float, default=120.0,
                        help="seconds to wait before each run for other jobs on these cores "
                        "to pause (default 120; 0: do not wait)")
    parser.add_argument("--attempts", type=int, default=3,
                        help="runs of a layout while other jobs disturb it (default 3)")
    parser.add_argument("--keep", type=Path, help="keep the runs in this (new) folder")
    args = parser.parse_args()
    info = harness.host_info()
    with tempfile.TemporaryDirectory(prefix="meshtron-cost-model-") as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        profile_path = folder / "profile.json"
        if args.profile:
            profile_path.write_text(args.profile.read_text())
        else:
            for _ in range(args.attempts):
                wait_for_quiet(args.quiet_wait)
                _, share = others_share(lambda: calibrate(args.calibrate_nproc, args.quick,
                                                          profile_path))
                print(f"other jobs took {share:.0%} of the CPU during the calibration")
                if share <= QUIET:
                    break
        profile = load_profile(str(profile_path))
        save_profile(dataclasses.replace(profile, time_correction=1.0, memory_correction=1.0),
                     profile_path)
        print(harness.host_line(info, f"profile: {profile.source}"), flush=True)
        env = dict(harness.EXACT_ALLOCATOR) if args.exact_allocator else None
        rows = []
        for item in (i for i in LAYOUTS if i.name in args.configs):
            rows.append(run_layout(item, profile_path, args.steps, folder, env,
                                   args.quiet_wait, args.attempts))
            print(" | ".join(cells(rows[-1])) + (f" ({rows[-1]['failure']})"
                                                 if rows[-1]["failure"] else ""), flush=True)
        fold_others(rows, profile.memory_reserved_bytes)
        print()
        print(harness.markdown_table(HEADER, [cells(r) for r in rows]))
        print(summary(rows))
        print(harness.host_line(harness.host_info(), "at the end"))
        harness.write_json(args.json, harness.record(
            info, arguments=harness.plain_args(args),
            profile=profile_to_dict(load_profile(str(profile_path))), layouts=rows,
            summary=summary(rows), machine_at_end=harness.host_info()))


if __name__ == "__main__":
    main()
