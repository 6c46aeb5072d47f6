"""``meshtron tune --calibrate`` as a command: check the arguments, launch the ranks that
measure (``calibrate.py``), write the profile, then train a probe model for a few steps through
the real trainer, price it with the profile just measured, and fold in what the kernel timings
miss.

GEMM, attention and copy timings price a step's kernels. A real step also runs elementwise
kernels (priced only by their bytes), Python dispatch, the autograd engine and the optimizer
loop; and a training process holds more than an imported trainer (the data pipeline,
TensorBoard's writer, autograd's buffers, gloo's buffers for each peer, the heap glibc keeps).
So the probe model trains on one process and, with ``--nproc N``, on N data-parallel ranks,
through ``meshtron train`` as a user runs it (the runner of ``tune --trial``), and:

- ``compute_correction`` = the one-process probes' measured step time, less the predicted
  optimizer and fixed overhead, over their predicted compute: a least-squares slope through
  the origin over two batch sizes (8 and 32 sequences), so that the larger step, whose time a
  scheduling hiccup of a few milliseconds hardly moves, weighs most. On a CPU these probes run
  on one thread, as every rank of a multi-rank CPU layout does, and are priced on one;
- on a CPU, ``thread_speedup`` = the larger probe's compute time on one thread over the same
  probe's on every core: what a one-process layout gains from its cores in a training step
  (a large GEMM alone, timed by the kernel measurement, read from 1.1x to 2.1x on 2 cores
  across three calibrations);
- on a CPU, ``memory_step_slack`` = what the larger one-process probe's peak holds beyond the
  same run's on the exact heap (``EXACT_HEAP``), per byte of its predicted step buffers
  (activations, logits): glibc's heap keeps freed chunks, and how much grows with what a step
  allocates and frees, not with the model's state;
- ``memory_reserved_bytes`` = the smaller one-process probe's measured peak less the model's
  predicted bytes (with that slack);
- ``memory_reserved_per_rank_bytes`` = what the N-rank probe's peak holds beyond that, per
  further rank.

These are calibration, not trial feedback: ``time_correction`` and ``memory_correction``
(which ``--trial`` folds in) stay as they were.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch.distributed as dist

from meshtron.config import Config, load_config
from meshtron.costmodel.estimate import Estimator
from meshtron.costmodel.memory_model import MemoryEstimate
from meshtron.costmodel.online import candidate_of
from meshtron.costmodel.priced import Estimate
from meshtron.costmodel.problem import Cluster, problem_of
from meshtron.costmodel.profiles import ClusterProfile, load_profile, save_profile
from meshtron.errors import MeshtronError
from meshtron.parallel.mesh.launch import launch_local
from meshtron.parallel.mesh.process import (
    ProcessInfo,
    device_for,
    die_with_launcher,
    init_process_group,
    process_info,
)
from meshtron.tune.calibrate import (
    RANK_TIMEOUT_S,
    measure_collectives,
    measure_process,
    profile_summary,
    torch_threads,
    with_collectives,
)
from meshtron.tune.copy_probe import reduce_scatter_copy
from meshtron.tune.trials import Trial, run_trial

PROBE_MODEL = ["--model.preset=tiny", "--model.num_layers=2", "--model.hidden_size=256",
               "--model.num_heads=4", "--model.num_kv_heads=4", "--model.ffn_hidden_size=768",
               "--model.vocab_size=512", "--data.vocab_size=512", "--data.corpus_max_mb=0.3",
               "--train.seq_len=128", "--train.global_batch=8"]
"""A small Llama-style model on a slice of the default corpus: its step is long enough to time
on a CPU and short enough that calibration stays a matter of a minute."""


EXACT_HEAP = MappingProxyType({"MALLOC_MMAP_THRESHOLD_": "65536"})
"""glibc's setting under which a process's resident memory follows its live tensors: every
allocation of 64 KiB or more is mapped on its own and unmapped when freed (a fixed threshold
also stops glibc raising it: with the default dynamic one, freed buffers under 32 MiB stay in
the heap)."""


ONE_THREAD = MappingProxyType({"OMP_NUM_THREADS": "1"})
"""A probe run as each rank of a CPU layout computes: on one thread."""


PROBE_STEPS = {False: 8, True: 4}
"""Steps of a probe run, full and ``--quick`` (the first, warm-up step is not timed)."""

PROBE_BATCHES = (8, 32)
"""Global batches of the one-process probes (one micro-batch each): the compute correction's
two points; the N-rank probe trains the first."""


def probe_config(global_batch: int) -> Config:
    return load_config(overrides=[*PROBE_MODEL, f"--train.global_batch={global_batch}"])


def price(cfg: Config, profile: ClusterProfile, nproc: int) -> Estimate:
    return Estimator(problem_of(cfg, Cluster(profile, nproc))).estimate(candidate_of(cfg, nproc))


def compute_seconds(t: Trial) -> float:
    """A probe's measured step less its predicted optimizer step and fixed overhead."""
    return t.measured.step_time_s - t.estimate.breakdown["optimizer"] \
        - t.estimate.breakdown["overhead"]


def compute_ratio(ones: list[Trial]) -> float:
    """Measured over predicted compute of the one-process probes: the least-squares slope
    through the origin of (measured step less optimizer and overhead) against compute."""
    points = [(t.estimate.breakdown["compute"], compute_seconds(t)) for t in ones]
    squares = max(sum(c * c for c, _ in points), 1e-24)
    return max(0.1, sum(c * m for c, m in points) / squares)


def model_bytes(memory: MemoryEstimate, slack: float) -> float:
    """The predicted peak beyond the reserved bytes, with the allocator's ``slack``."""
    return dataclasses.replace(memory, slack=slack).peak - memory.reserved


def step_slack(held: Trial, exact: Trial | None) -> float:
    """What the default heap holds beyond the exact one's, per byte of the probe's step
    buffers: the same probe run twice, once with the heap that returns what it frees."""
    if exact is None or exact.measured is None:
        return 0.0
    buffers = max(1.0, held.estimate.memory.step_buffers)
    return round(max(0.0, held.measured.memory_bytes - exact.measured.memory_bytes) / buffers, 3)


@dataclass(frozen=True)
class Probes:
    """What the probe runs measured, each priced with the profile being fitted."""

    threaded: list[Trial]
    """One process on every thread, at each of PROBE_BATCHES."""
    single: list[Trial] = field(default_factory=list)
    """CPU: the same on one thread (priced on one), as each rank of a CPU layout runs."""
    many: Trial | None = None
    """The N data-parallel ranks."""
    exact: Trial | None = None
    """CPU: the largest threaded probe again on the exact heap."""


def fitted(profile: ClusterProfile, probes: Probes, nproc: int) -> ClusterProfile:
    """The profile with what the probes measured folded in (see the module's docstring)."""
    threaded = probes.threaded
    slack = step_slack(threaded[-1], probes.exact)
    speedup = profile.thread_speedup
    if probes.single:  # one-thread compute is what every CPU rank prices; a process's cores
        correction = profile.compute_correction * compute_ratio(probes.single)
        gain = compute_seconds(probes.single[-1]) / max(1e-9, compute_seconds(threaded[-1]))
        speedup = round(min(max(1.0, gain), float(profile.compute_units or 1)), 3)
    else:
        correction = profile.compute_correction * compute_ratio(threaded)
    first = threaded[0]
    reserved = max(0, first.measured.memory_bytes - model_bytes(first.estimate.memory, slack))
    per_rank = 0
    many = probes.many
    if many is not None and many.measured is not None and nproc > 1:
        model = model_bytes(many.estimate.memory, slack)
        per_rank = max(0, (many.measured.memory_bytes - model - reserved) / (nproc - 1))
    return dataclasses.replace(profile, compute_correction=round(correction, 4),
                               thread_speedup=speedup, memory_reserved_bytes=int(reserved),
                               memory_reserved_per_rank_bytes=int(per_rank),
                               memory_step_slack=slack)


@dataclass(frozen=True, eq=False)
class ProbeRun:
    ranks: int
    batch: int
    env: Mapping[str, str] | None = None
    how: str = ""
    """How the run differs, for the log: ' on one thread', ' on the exact heap'."""

    def describe(self) -> str:
        return f"{self.batch} sequences on {self.ranks} rank{'s' if self.ranks > 1 else ''}" \
            f"{self.how}"


def run_probes(output: Path, nproc: int, steps: int) -> ClusterProfile:
    """Train the probes (see the module's docstring), fold what they measured into the
    profile at ``output`` and write it back; says what it found."""
    profile = load_profile(str(output))
    cpu = profile.compute_units is not None
    threaded = [ProbeRun(1, b) for b in PROBE_BATCHES]
    single = [ProbeRun(1, b, ONE_THREAD, " on one thread") for b in PROBE_BATCHES] if cpu else []
    many = [ProbeRun(nproc, PROBE_BATCHES[0])] if nproc > 1 else []
    exact = [ProbeRun(1, PROBE_BATCHES[-1], EXACT_HEAP, " on the exact heap")] if cpu else []
    done: dict[ProbeRun, Trial] = {}
    with tempfile.TemporaryDirectory(prefix="meshtron-probe-") as folder:
        for index, run in enumerate(threaded + single + many + exact):
            cfg = probe_config(run.batch)
            print(f"probe: training a 2-layer, 256-wide model for {steps} steps of "
                  f"{run.describe()}", file=sys.stderr, flush=True)
            priced = dataclasses.replace(profile, thread_speedup=1.0) \
                if run.env is ONE_THREAD else profile
            trial = run_trial(cfg, price(cfg, priced, run.ranks), index, run.ranks, steps,
                              Path(folder), run.env)
            if trial.measured is None:
                raise MeshtronError(f"the probe of {run.describe()} failed: {trial.failure} "
                                    "(calibrate with --no-probe to skip it)")
            done[run] = trial
    probes = Probes([done[r] for r in threaded], [done[r] for r in single],
                    done[many[0]] if many else None, done[exact[0]] if exact else None)
    new = fitted(profile, probes, nproc)
    save_profile(new, output)
    fit = probes.single or probes.threaded
    measured = ", ".join(f"{t.measured.step_time_s:.3f} s vs {t.estimate.step_time_s:.3f} s"
                         for t in fit)
    one = probes.threaded[0]
    print(f"  probes on 1 rank{' and one thread' if cpu else ''} "
          f"({' and '.join(map(str, PROBE_BATCHES))} sequences): {measured} "
          f"from the kernels alone: compute_correction {new.compute_correction:.3f}; "
          f"{one.measured.memory_bytes / 2**20:,.0f} MiB peak, "
          f"{new.memory_reserved_bytes / 2**20:,.0f} MiB of it besides the model", flush=True)
    if cpu:
        print(f"  on every core a step computes {new.thread_speedup:.2f}x faster than on one "
              f"(a large GEMM: {profile.thread_speedup:.2f}x); the heap keeps "
              f"{new.memory_step_slack:.2f} bytes per byte of a step's buffers (the larger "
              "probe on the default heap vs the exact one)", flush=True)
    if nproc > 1:
        print(f"  probe on {nproc} ranks: each further rank adds "
              f"{new.memory_reserved_per_rank_bytes / 2**20:,.1f} MiB per rank", flush=True)
    return new


def check_arguments(nproc: int, output: Path) -> None:
    """Refuse what cannot work before any process starts or anything is measured."""
    if nproc < 1:
        raise MeshtronError(f"--nproc must be at least 1, got {nproc}")
    if output.is_dir():
        raise MeshtronError(f"--output {output} is a folder: name the profile file, for "
                            f"example {output / 'profile.json'}")
    folder = output.parent
    if not folder.is_dir():
        raise MeshtronError(f"--output {output}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise MeshtronError(f"--output {output}: the folder {folder} is not writable")


def forwarded(output: Path, quick: bool) -> list[str]:
    """The arguments of ``meshtron tune`` that every launched rank gets (no ``--nproc``: a
    launched rank takes the world size, and torchrun's own parser would read it as its
    ``--nproc-per-node``; no probe: the launching process runs it once the ranks are done)."""
    return ["--calibrate", f"--output={output.resolve()}", *(["--quick"] if quick else []),
            "--no-probe"]


def run_calibrate(nproc: int, output: Path, quick: bool = False, probe: bool = True) -> int:
    """The ``tune --calibrate`` command: validate, launch ``nproc`` ranks (none under
    torchrun, where the ranks exist already), measure, write the profile from rank 0, then
    (``probe``) train the probe model and fold in what it measured."""
    info = process_info()
    try:
        check_arguments(nproc, output)
    except MeshtronError:
        if info.distributed and info.rank != 0:
            return 2  # every rank sees the same error: rank 0 says it
        raise
    if nproc > 1 and not info.distributed:
        launch_local(nproc, forwarded(output, quick), command="tune")
    else:
        profile = _calibrate_rank(info, quick)
        if profile is None:
            return 0
        save_profile(profile, output)
        print(profile_summary(profile, output), flush=True)
    if probe:
        run_probes(output, max(nproc, info.world_size), PROBE_STEPS[quick])
    return 0


def _calibrate_rank(info: ProcessInfo, quick: bool) -> ClusterProfile | None:
    """This rank's part: rank 0 measures the process alone while the others wait, then all
    measure the collectives; rank 0 returns the profile, the others None."""
    if info.distributed:
        die_with_launcher()
        init_process_group(info, RANK_TIMEOUT_S)
    device = device_for(info)
    profile = measure_process(quick, device) if info.rank == 0 else None
    if not info.distributed:
        return profile
    dist.barrier()
    with torch_threads(1):
        fits = measure_collectives(quick, info.world_size, info.rank, device)
        copy = reduce_scatter_copy(info.world_size, device)
    if profile is None:
        return None
    return with_collectives(profile, fits, info.world_size, device, copy)
