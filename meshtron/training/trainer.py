"""The training loop: step, evaluate, log, save, with a run's other parts as observers.

:class:`Trainer` assembles one rank (:func:`~meshtron.rank.build_rank`), resumes it, and runs
the loop in :meth:`Trainer.run`. What a run does besides training (straggler watch, online
re-tuning, MoE and MTP statistics, zb-v's measured order, evaluation samples, the metrics
files and console, timed saves) follows the loop as observers
(:mod:`meshtron.training.observers`); fault injection wraps the step's batch and loss
(:mod:`meshtron.training.faults`).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshtron.checkpoint import train_state
from meshtron.checkpoint.encoder_weights import load_pretrained_encoders
from meshtron.checkpoint.lora_state import lora_meta
from meshtron.checkpoint.saver import CheckpointSaver
from meshtron.checkpoint.shards import Piece, check_finite
from meshtron.checkpoint.store import new_token
from meshtron.config import Config
from meshtron.data.builders import RunData, build_run_data
from meshtron.data.chat_template import CONFIG_FILE, TEMPLATE_FILE
from meshtron.errors import MeshtronError
from meshtron.optim.lr_schedule import learning_rate
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.plan import RunPlan, plan_run
from meshtron.precision.policy import cpu_low_precision_note
from meshtron.rank import Rank, build_rank
from meshtron.training.autotune import OnlineTuner
from meshtron.training.eval_samples import EvalSamples
from meshtron.training.faults import FaultPlan
from meshtron.training.hardware import peak_source
from meshtron.training.memory import check_state_fits
from meshtron.training.metrics import MetricsWriter
from meshtron.training.metrics_log import MetricsLog, peak_memory_bytes
from meshtron.training.model_stats import MoeRouting, MtpLosses
from meshtron.training.observers import Observer, Observers, StepReport
from meshtron.training.plot import plot_runs
from meshtron.training.progress import ProgressBar
from meshtron.training.resume import resume
from meshtron.training.retune import Retune
from meshtron.training.run_dir import check_run_dir
from meshtron.training.save_schedule import SaveSchedule
from meshtron.training.skips import SkipCount
from meshtron.training.startup_report import activation_line, fp8_line, run_lines, state_line
from meshtron.training.step import StepResult, evaluate, train_step
from meshtron.training.stragglers import Stragglers, StragglerWatch
from meshtron.training.watchdog import job_watchdog
from meshtron.training.zbv_order import ZbvOrder

Log = Callable[[str], None]


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int
    end_step: int
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_loss: float | None = None
    checkpoint: Path | None = None
    relayout: Path | None = None
    """``train.autotune=layout`` chose a new layout (this file): the ranks restart into it."""


def _quiet(message: str) -> None:
    """The log function of ranks other than 0."""


class Trainer:
    """Owns one rank's share of a run. Only global rank 0 logs and writes the run directory.

    The run follows the plan of ``cfg`` on the mesh's world size (``mesh`` must have the
    layout the plan gives), made once the tokenizer is known: ``self.cfg`` is the planned
    config, with the model's vocabulary resolved. A caller that planned already (the command
    line) passes its ``plan``, which is then used as it is.
    ``checked``: the caller made the start-up checks (the run directory, the training
    state's memory) in this process already."""

    def __init__(self, cfg: Config, mesh: ParallelMesh | None = None, log: Log = print,
                 device: torch.device | None = None, plan: RunPlan | None = None, *,
                 checked: bool = False):
        self.mesh = mesh or ParallelMesh.single()
        self.is_rank0 = self.mesh.global_rank == 0
        self.log = log if self.is_rank0 else _quiet
        self.warn = self._warn_on_stderr if log is print and self.is_rank0 else (
            lambda message: self.log(f"warning: {message}"))
        self.device = device or torch.device("cpu")
        self.run_dir = Path(cfg.run.dir)
        if not checked:  # else the train command did, before any process group
            check_run_dir(cfg)
        torch.manual_seed(cfg.train.seed)
        self.data = self._build_data(plan.config if plan is not None else cfg)
        self.plan = plan or self._plan(cfg)
        self.cfg = cfg = self.plan.config
        if not checked:
            check_state_fits(cfg, self.mesh.layout, self.device)
        self.rank: Rank = build_rank(self.plan, self.mesh, self.device,
                                     eos_id=self.data.tokenizer.eos_id,
                                     load_weights=load_pretrained_encoders)
        self.peak_flops, self.peak_source = peak_source(self.device, cfg.train.peak_flops,
                                                        cfg.data.cache_dir)
        self.faults = FaultPlan(self.mesh.global_rank)
        self.tuner = OnlineTuner(cfg, self.mesh, self.micro_batch, self.device) \
            if cfg.train.autotune != "off" else None
        self._report_start()
        self.saver = CheckpointSaver(
            cfg.checkpoint_dir, self.mesh.global_rank, self.mesh.layout.world_size,
            self._shared_token(), keep_last=cfg.checkpoint.keep_last,
            asynchronous=cfg.checkpoint.async_, timeout_s=cfg.run.timeout_s,
            after_shard=self.faults.in_save if self.faults else None)
        self.step = resume(cfg, self.rank, self.run_dir, self.log, self.warn)
        self.skips = SkipCount(cfg, self.precision.scaler is not None, self.warn)
        if self.is_rank0:  # written once the run is known to start (a refused resume keeps it)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.run_dir / "config.yaml")

    # The rank's parts, as the loop runs them (train.autotune may re-plan the micro-batch).
    model = property(lambda self: self.rank.model)
    optimizer = property(lambda self: self.rank.optimizer)
    precision = property(lambda self: self.rank.precision)
    pipeline = property(lambda self: self.rank.pipeline)
    split = property(lambda self: self.rank.split)
    micro_batch = property(lambda self: self.rank.micro_batch)
    skipped_steps = property(lambda self: self.skips.total)

    def _plan(self, cfg: Config) -> RunPlan:
        cfg = self.data.resolved(cfg)  # e.g. a policy's action range, from the dataset
        plan = plan_run(cfg, self.mesh.layout.world_size, self.data.tokenizer.vocab_size)
        if plan.layout != self.mesh.layout:
            raise MeshtronError(f"the mesh's layout {self.mesh.layout} is not the config's "
                                f"{plan.layout}")
        return plan

    def _report_start(self) -> None:
        """The start-up lines: the plan, activations, optimizer state, fp8, slow dtypes."""
        cfg, rank = self.cfg, self.rank
        if cfg.parallel.zero and not self.optimizer.zero_stage:
            self.log(f"parallel.zero={cfg.parallel.zero} with a single data-parallel rank: "
                     "nothing to shard, running as zero 0")
        lines = run_lines(cfg, self.plan, self.model.padded_vocab)
        schedule = rank.pipeline.schedule if rank.pipeline is not None else None
        lines += [activation_line(cfg, len(self.model.blocks()), schedule, self.mesh.pp.rank,
                                  self.micro_batch),
                  state_line(cfg, self.optimizer, rank.local_params),
                  fp8_line(cfg.precision, self.device)]
        for line in filter(None, lines):
            self.log(line)
        slow = cpu_low_precision_note(cfg.precision.dtype, self.device)
        if slow:
            self.warn(slow)

    @staticmethod
    def _warn_on_stderr(message: str) -> None:
        """Warnings of a run that logs to the console go where errors go, not into the log."""
        print(f"warning: {message}", file=sys.stderr)

    def _build_data(self, cfg: Config) -> RunData:
        """Local rank 0 fills the tokenizer/dataset caches first; the others then read them."""
        def build() -> RunData:
            return build_run_data(cfg, self.log)

        if self.mesh.world.pg is None:
            return build()
        first = int(os.environ.get("LOCAL_RANK", self.mesh.global_rank)) == 0
        data, error = None, None
        if first:
            try:
                data = build()
            except MeshtronError as err:  # still meet the others, who then fail alike
                error = err
        torch.distributed.barrier()
        if error is not None:
            raise error
        return data or build()

    def local_share(self, batch: torch.Tensor) -> torch.Tensor:
        """This data-parallel rank's rows of a global batch."""
        return self.rank.local_share(batch)

    def _shared_token(self) -> str:
        """One random token per run, the same on every rank (names temporary save dirs)."""
        token = [new_token()]
        if self.mesh.world.pg is not None:
            torch.distributed.broadcast_object_list(token, src=0)
        return token[0]

    def save(self) -> Path:
        """Write a checkpoint: each rank its own shard (in the background with
        ``checkpoint.async``), the first rank the index. No collectives when asynchronous."""
        cfg = self.cfg
        background = cfg.checkpoint.async_
        self.saver.wait()  # the host buffers below belong to the save in flight until it ends

        def pieces() -> list[Piece]:  # on the saver's thread when in the background
            captured = train_state.capture(self.model, self.optimizer, self.mesh,
                                           self.saver.buffers, copy=background)
            for piece in captured:  # never a checkpoint with a NaN in it
                check_finite(cfg.checkpoint_dir, f"{piece.name} (about to be saved)",
                             piece.data)
            return captured

        meta = {"config": cfg.to_dict(), "layout": self.mesh.layout.sizes(),
                "data": {"next_batch": self.step, "seed": cfg.train.seed},
                **train_state.state_meta(self.optimizer, self.precision.scaler),
                **lora_meta(self.model)}
        if background:  # the capture runs beside the next forward/backward, not the update
            self.optimizer.fence_next_update(self.saver.wait_captured)
        path = self.saver.save(self.step, pieces, meta, self._tokenizer_files())
        if not background and self.mesh.world.pg is not None:
            torch.distributed.barrier()  # the first rank has moved the checkpoint into place
        return path

    def _tokenizer_files(self) -> dict[str, Path]:
        """The tokenizer and, where they sit beside it (an imported model's), its config and
        chat template: a checkpoint serves chat requests wherever it is moved."""
        tokenizer = Path(self.data.tokenizer.path)
        beside = (tokenizer.parent / name for name in (CONFIG_FILE, TEMPLATE_FILE))
        return {"tokenizer.json": tokenizer, **{p.name: p for p in beside if p.is_file()}}

    def finish_saving(self) -> None:
        """Wait for a background save (every rank), then for each other."""
        self.saver.close()
        if self.mesh.world.pg is not None:
            torch.distributed.barrier()

    def validation_loss(self) -> float:
        t = self.cfg.train
        return evaluate(self.rank, [self.local_share(self.data.valid_batch(i, t.global_batch))
                                    for i in range(t.eval_batches)])

    def run(self) -> TrainResult:
        """The loop: train a step, tell the observers, evaluate, log, save; until
        ``train.steps`` or a restart into a new layout (``train.autotune=layout``)."""
        t = self.cfg.train
        result = TrainResult(self.run_dir, self.step, self.step)
        if self.step >= t.steps:
            self.log(f"run already complete at step {self.step} (train.steps={t.steps}); "
                     "raise train.steps or use a new run.dir to train more")
            return result
        observers = Observers(self._observers())
        self.mesh.stats.take()
        with self._watchdog() as phase, contextlib.closing(observers):
            while self.step < t.steps and result.relayout is None:
                phase(f"step {self.step + 1}")
                report = self._train_step()
                result.losses.append(report.out.loss)
                result.grad_norms.append(report.out.grad_norm)
                observers.on_step(report)
                self.rank = report.rank
                if report.evaluate:
                    phase(f"the validation at step {self.step}")
                    result.val_loss = report.val_loss = self.validation_loss()
                    report.row.update(val_loss=result.val_loss, val_ppl=math.exp(result.val_loss))
                    observers.on_eval(report)
                observers.on_row(report)
                if report.save:
                    phase(f"saving the checkpoint of step {self.step}")
                    result.checkpoint = report.checkpoint = self.save()
                    observers.on_save(report)
                result.relayout = report.restart
            phase("waiting for the last save of every rank")
            self.finish_saving()
        result.end_step = self.step
        self._plot()
        return result

    def _train_step(self) -> StepReport:
        """One optimizer step (this step's faults injected), timed, counted, and its row."""
        t = self.cfg.train
        self.saver.check()
        started = time.perf_counter()
        lr = learning_rate(self.step, t)
        batch = self.local_share(self.data.train_batch(self.step, t.global_batch))
        with self.faults.injected(self.step + 1, self.rank) as rank:
            out = train_step(rank, batch, lr)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - started
        self.step += 1
        self.skips.add(self.step, out)
        last = self.step == t.steps
        return StepReport(self.step, out, lr, elapsed, self.rank, self._row(out, lr, elapsed),
                          last, evaluate=bool(t.eval_every) and (self.step % t.eval_every == 0
                                                                 or last))

    def _row(self, out: StepResult, lr: float, elapsed: float) -> dict:
        """The step's metrics row (the observers add theirs)."""
        flops, peak = self.plan.flops_per_step, self.peak_flops
        return {
            "step": self.step, "loss": out.loss, "lr": lr, "grad_norm": out.grad_norm,
            "tokens_per_s": self.plan.input_tokens_per_step / elapsed, "step_time_s": elapsed,
            "mem_peak_bytes": peak_memory_bytes(self.device),
            "mfu": flops / elapsed / (peak * self.mesh.layout.world_size),
            "skipped": out.skipped, "skipped_steps": self.skips.total,
            "compute_s": out.compute_s, "comm_bytes": self.mesh.stats.take(),
            "loss_tokens": out.loss_tokens,
        }

    def _observers(self) -> list[Observer]:
        """The run's observers, in the order they hear of each step (every rank alike)."""
        cfg, t = self.cfg, self.cfg.train
        self.log(f"mfu: against {self.peak_flops / 1e12:.3g} TFLOP/s per rank, from "
                 f"{self.peak_source}")
        wandb = (cfg.run.wandb, cfg.run.wandb_project, cfg.to_dict()) \
            if cfg.run.wandb != "off" else None
        writer = MetricsWriter(self.run_dir, wandb) if self.is_rank0 else None
        progress = ProgressBar(t.steps, self.step, cfg.run.progress and self.is_rank0)
        observers: list[Observer] = [
            MetricsLog(writer, self.log, progress, t.steps, t.log_every, t.compile)]
        p = cfg.parallel
        if p.zb_v_measured_order and self.pipeline is not None:
            observers.append(ZbvOrder(p.zb_v_measured_order, p.receives_ahead, self.log))
        observers.append(Stragglers(StragglerWatch(self.mesh, cfg.run.straggler_every,
                                                   cfg.run.straggler_factor, self.device),
                                    self.warn, writer))
        if self.tuner is not None:
            observers.append(Retune(self.tuner, self.run_dir, self.log, writer, self.is_rank0))
        if cfg.model.is_moe:
            observers.append(MoeRouting(cfg.model))
        if cfg.model.mtp_depth:
            observers.append(MtpLosses())
        if t.eval_every and t.eval_generate:
            observers.append(EvalSamples(self.data.valid_batch(0, t.global_batch),
                                         t.eval_generate, self.data.tokenizer, self.log, writer))
        observers.append(SaveSchedule(cfg.checkpoint.every, cfg.checkpoint.every_seconds,
                                      self.mesh))
        return observers

    @contextlib.contextmanager
    def _watchdog(self) -> Iterator[Log]:
        """``run.timeout_s`` on a job of several processes: a phase function to say where
        this rank is (what a stuck collective's report names)."""
        watchdog = job_watchdog(self.mesh.global_rank, self.mesh.layout.world_size,
                                self.cfg.run.timeout_s) if self.mesh.world.pg is not None else None
        if watchdog is None:  # one process, or no store to meet the others in
            yield _quiet
            return
        watchdog.start()
        try:
            yield watchdog.phase
        finally:
            watchdog.stop()

    def _plot(self) -> None:
        if self.is_rank0 and self.cfg.run.plot:
            try:
                plot_runs([self.run_dir], self.run_dir / "loss.png")
            except MeshtronError as err:  # e.g. every logged loss was skipped as NaN
                self.warn(f"no loss.png: {err}")


def train(cfg: Config, mesh: ParallelMesh | None = None, log: Log = print,
          device: torch.device | None = None, plan: RunPlan | None = None, *,
          checked: bool = False) -> TrainResult:
    """Train per ``cfg`` (resuming when a checkpoint exists) and return a summary;
    ``plan``: the plan of ``cfg`` when the caller made it already."""
    trainer = Trainer(cfg, mesh, log, device, plan, checked=checked)
    result = trainer.run()
    sys.stdout.flush()
    return result
