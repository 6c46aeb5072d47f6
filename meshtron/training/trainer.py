"""The training loop: data, model, optimizer, resume, steps, evaluation, metrics, checkpoints."""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshtron.checkpoint import train_state
from meshtron.checkpoint.encoder_weights import load_pretrained_encoders
from meshtron.checkpoint.saver import CheckpointSaver
from meshtron.checkpoint.shards import Piece, check_finite
from meshtron.checkpoint.store import find_latest, new_token, open_checkpoint, step_dir_name
from meshtron.config import Config, PrecisionConfig
from meshtron.data.builders import RunData, build_run_data, row_format
from meshtron.errors import MeshtronError
from meshtron.models.init import initialize
from meshtron.models.moe import step_routing_stats
from meshtron.models.transformer import Transformer
from meshtron.optim.data_parallel import build_optimizer
from meshtron.optim.lr_schedule import learning_rate
from meshtron.parallel.context.sequence import SequenceSplit
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.pipeline.executor import PipelineExecutor
from meshtron.parallel.pipeline.measured_order import MeasuredOrder
from meshtron.parallel.tensor.collectives import all_reduce
from meshtron.parallel.tensor.linear import FP8Options
from meshtron.plan import plan_run
from meshtron.precision.fp8 import make_recipe
from meshtron.precision.policy import Precision, cpu_low_precision_note
from meshtron.training.autotune import (
    LAYOUT_FILE,
    OnlineTuner,
    describe,
    write_chosen_layout,
)
from meshtron.training.eval_samples import eval_samples
from meshtron.training.faults import FaultPlan
from meshtron.training.finetune_start import finetune_report
from meshtron.training.hardware import peak_source
from meshtron.training.memory import check_state_fits
from meshtron.training.metrics import MetricsWriter, format_row
from meshtron.training.plot import plot_runs
from meshtron.training.progress import ProgressBar
from meshtron.training.run_dir import (
    check_resumable,
    check_run_dir,
    resume_path,
    set_aside_later_checkpoints,
    set_aside_later_metrics,
)
from meshtron.training.startup_report import activation_line, fp8_line, run_lines, state_line
from meshtron.training.step import StepResult, evaluate, too_many_skips, train_step
from meshtron.training.stragglers import StragglerWatch
from meshtron.training.watchdog import job_watchdog

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


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def fp8_options(pc: PrecisionConfig, mesh: ParallelMesh) -> FP8Options:
    """One layer's FP8 settings. Tensor-wise amaxes are agreed over tp and cp (the ranks that
    hold parts of the same tensors), so every layout scales alike (block-wise tiles are local
    to each shard and need no agreement)."""
    group = mesh.tp_cp

    def agree(amax: torch.Tensor) -> torch.Tensor:
        return all_reduce(amax, group, op=torch.distributed.ReduceOp.MAX)

    knobs: dict = {"block": pc.fp8_block} if pc.fp8 == "blockwise" else {}
    if pc.fp8 == "delayed":
        knobs = {"history_len": pc.fp8_history, "reduction": pc.fp8_amax}
    return FP8Options(make_recipe(pc.fp8, agree if group.pg is not None else None, **knobs),
                      pc.fp8_grad)


def _quiet(message: str) -> None:
    """The log function of ranks other than 0."""


class Trainer:
    """Owns one rank's share of a run. Only global rank 0 logs and writes the run directory.

    The run follows the plan of ``cfg`` on the mesh's world size (``mesh`` must have the
    layout the plan gives), made once the tokenizer is known: ``self.cfg`` is the planned
    config, with the model's vocabulary resolved.
    ``checked``: the caller made the start-up checks (the run directory, the training
    state's memory) in this process already."""

    def __init__(self, cfg: Config, mesh: ParallelMesh | None = None, log: Log = print,
                 device: torch.device | None = None, *, checked: bool = False):
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

        self.data = self._build_data(cfg)
        cfg = self.data.resolved(cfg)  # e.g. a policy's action range, from the dataset
        self.plan = plan = plan_run(cfg, self.mesh.layout.world_size,
                                    self.data.tokenizer.vocab_size)
        if plan.layout != self.mesh.layout:
            raise MeshtronError(f"the mesh's layout {self.mesh.layout} is not the config's "
                                f"{plan.layout}")
        self.cfg = cfg = plan.config
        p, pc = cfg.parallel, cfg.precision
        self.precision = Precision(pc.dtype, self.device, loss_scaling=pc.loss_scaling,
                                   reduce_dtype=pc.reduce_dtype)
        options = plan.model_options(
            self.mesh.pp.rank,
            fp8=(lambda: fp8_options(pc, self.mesh)) if pc.fp8 != "none" else None,
            aux_loss_weight=lambda: self.precision.loss_scale / plan.tokens_per_step)
        if not checked:
            check_state_fits(cfg, self.mesh.layout, self.device)
        self.model = Transformer(cfg.model, self.mesh, options)
        initialize(self.model, seed=cfg.train.seed, std=cfg.model.init_std,
                   num_layers=cfg.model.num_layers)
        load_pretrained_encoders(self.model)
        self.model.to(self.device).train()
        self.precision.cast_parameters(self.model)
        self.local_params = sum(p.numel() for p in self.model.parameters())  # before ZeRO-3
        self.optimizer = build_optimizer(self.model, self.mesh, cfg.train, zero=p.zero,
                                         bucket_mb=p.bucket_mb,
                                         reduce_dtype=self.precision.reduce_dtype)
        if p.zero and not self.optimizer.zero_stage:
            self.log(f"parallel.zero={p.zero} with a single data-parallel rank: nothing to "
                     "shard, running as zero 0")
        self.micro_batch = plan.micro_batch
        self.dp_share = plan.dp_share
        self.split = SequenceSplit(self.mesh.cp, cfg.data.document_mask,
                                   cfg.data.reset_positions, self.data.tokenizer.eos_id,
                                   cfg.model.mtp_depth, row_format(cfg.model))
        self.pipeline = None
        if plan.schedule is not None:
            self.pipeline = PipelineExecutor(self.model, self.mesh, plan.partition,
                                             plan.schedule, cfg.model.hidden_size)
        self.reorder = MeasuredOrder(p.zb_v_measured_order, p.receives_ahead) \
            if p.zb_v_measured_order else None
        self.step = 0
        self.skipped_steps = 0
        self.faults = FaultPlan(self.mesh.global_rank)
        self.stragglers = StragglerWatch(self.mesh, cfg.run.straggler_every,
                                         cfg.run.straggler_factor, self.device)
        self.tuner = OnlineTuner(cfg, self.mesh, self.micro_batch, self.device) \
            if cfg.train.autotune != "off" else None
        for line in run_lines(cfg, plan, self.model.padded_vocab):
            self.log(line)
        self.optimizer.init_state()  # torch's AdamW would create it at the first step
        schedule = self.pipeline.schedule if self.pipeline is not None else None
        for line in (activation_line(cfg, len(self.model.blocks()), schedule, self.mesh.pp.rank,
                                     self.micro_batch),
                     state_line(cfg, self.optimizer, self.local_params),
                     fp8_line(cfg.precision, self.device)):
            if line:
                self.log(line)
        slow = cpu_low_precision_note(pc.dtype, self.device)
        if slow:
            self.warn(slow)
        self.saver = CheckpointSaver(
            cfg.checkpoint_dir, self.mesh.global_rank, self.mesh.layout.world_size,
            self._shared_token(), keep_last=cfg.checkpoint.keep_last,
            asynchronous=cfg.checkpoint.async_, timeout_s=cfg.run.timeout_s,
            after_shard=self.faults.in_save if self.faults else None)
        self._maybe_resume()
        if self.is_rank0:  # written once the run is known to start (a refused resume keeps it)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.run_dir / "config.yaml")

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
        start = self.mesh.dp.rank * self.dp_share
        return batch[start : start + self.dp_share].to(self.device)

    def _shared_token(self) -> str:
        """One random token per run, the same on every rank (names temporary save dirs)."""
        token = [new_token()]
        if self.mesh.world.pg is not None:
            torch.distributed.broadcast_object_list(token, src=0)
        return token[0]

    def _maybe_resume(self) -> None:
        c = self.cfg.checkpoint
        if not c.resume:
            return
        root = self.cfg.checkpoint_dir
        if c.resume_from is not None:
            path: Path | None = resume_path(root, c.resume_from)
        else:
            path = find_latest(root, warn=self.warn, on_corrupt=c.on_corrupt)
        if path is None:
            return
        manifest, reader = open_checkpoint(path)
        check_resumable(self.cfg, manifest, path)
        train_state.restore(path, manifest, reader, self.model, self.optimizer, self.mesh,
                            self.precision.scaler, self.log)
        finetune_report(manifest, self.cfg.train, self.log, self.warn)
        self.step = int(manifest["step"])
        saved_layout = manifest.get("layout")
        moved = (f"; saved under {_layout_text(saved_layout)}, resharded to "
                 f"{_layout_text(self.mesh.layout.sizes())}"
                 if isinstance(saved_layout, dict) and saved_layout != self.mesh.layout.sizes()
                 else "")
        self.log(f"resumed from {path} at step {self.step}{moved}")
        if self.mesh.world.pg is not None:
            torch.distributed.barrier()  # every rank has read it before anything is renamed
        if self.is_rank0:
            if root.is_dir():
                for moved in set_aside_later_checkpoints(root, self.step):
                    self.log(f"set aside the later checkpoint as {moved}")
            replaced = set_aside_later_metrics(self.run_dir, self.step)
            if replaced:
                self.log(f"moved {replaced} metric rows of steps after {self.step} to "
                         f"{self.run_dir / 'metrics.replaced.jsonl'}")

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
                **train_state.state_meta(self.optimizer, self.precision.scaler)}
        if background:  # the capture runs beside the next forward/backward, not the update
            self.optimizer.fence_next_update(self.saver.wait_captured)
        path = self.saver.save(self.step, pieces, meta,
                               {"tokenizer.json": Path(self.data.tokenizer.path)})
        if not background and self.mesh.world.pg is not None:
            torch.distributed.barrier()  # the first rank has moved the checkpoint into place
        return path

    def finish_saving(self) -> None:
        """Wait for a background save (every rank), then for each other."""
        self.saver.close()
        if self.mesh.world.pg is not None:
            torch.distributed.barrier()

    def validation_loss(self) -> float:
        t = self.cfg.train
        batches = [self.local_share(self.data.valid_batch(i, t.global_batch))
                   for i in range(t.eval_batches)]
        return evaluate(self.model, batches, self.micro_batch,
                        t.eval_batches * self.plan.tokens_per_step, self.mesh, self.pipeline,
                        self.split)

    def _sample(self, writer: MetricsWriter | None) -> None:
        """``train.eval_generate``: greedy continuations of fixed validation prompts, on every
        rank (the engine's collectives), logged once."""
        samples = eval_samples(self.model, self.mesh,
                               self.data.valid_batch(0, self.cfg.train.global_batch),
                               self.cfg.train.eval_generate, self.data.tokenizer)
        for i, (prompt, text) in enumerate(samples):
            self.log(f"sample {i + 1} at step {self.step}: {prompt!r} -> {text!r}")
            if writer:
                writer.write_text(f"samples/{i + 1}", f"{prompt} ▸ {text}", self.step)

    def run(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        result = TrainResult(self.run_dir, self.step, self.step)
        if self.step >= t.steps:
            self.log(f"run already complete at step {self.step} (train.steps={t.steps}); "
                     "raise train.steps or use a new run.dir to train more")
            return result
        tokens_per_step = self.plan.tokens_per_step
        flops_per_step = self.plan.flops_per_step
        peak, source = peak_source(self.device, t.peak_flops)
        self.log(f"mfu: against {peak / 1e12:.3g} TFLOP/s per rank, from {source}")
        wandb = (cfg.run.wandb, cfg.run.wandb_project, cfg.to_dict()) \
            if cfg.run.wandb != "off" else None
        writer = MetricsWriter(self.run_dir, wandb) if self.is_rank0 else None
        progress = ProgressBar(t.steps, self.step, cfg.run.progress and self.is_rank0)
        self.mesh.stats.take()
        consecutive_skips, last_save = 0, time.monotonic()
        watchdog = job_watchdog(self.mesh.global_rank, self.mesh.layout.world_size,
                                cfg.run.timeout_s) if self.mesh.world.pg is not None else None
        phase = watchdog.phase if watchdog else _quiet
        if watchdog:
            watchdog.start()
        try:
            while self.step < t.steps:
                self.saver.check()
                phase(f"step {self.step + 1}")
                self.faults.before_step(self.step + 1)
                started = time.perf_counter()
                lr = learning_rate(self.step, t)
                batch = self.local_share(self.data.train_batch(self.step, t.global_batch))
                out = train_step(
                    self.model, self.optimizer, batch, self.mesh,
                    global_tokens=tokens_per_step, micro_batch=self.micro_batch,
                    lr=lr, grad_clip=t.grad_clip,
                    precision=self.precision, pipeline=self.pipeline, split=self.split,
                    poison=self.faults.poison_loss(self.step + 1),
                    slow_down_s=self.faults.slow_seconds(self.step + 1),
                )
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                elapsed = time.perf_counter() - started
                if t.compile and not result.losses:
                    self.log(f"train.compile: the first step took {elapsed:.1f} s, compile "
                             "included")
                self.step += 1
                if self.reorder and self.pipeline and (
                        line := self.reorder.after_step(self.pipeline, self.mesh)):
                    self.log(line)
                result.losses.append(out.loss)
                result.grad_norms.append(out.grad_norm)
                consecutive_skips = consecutive_skips + 1 if out.skipped else 0
                self.skipped_steps += out.skipped
                if out.skipped:
                    self._check_skips(out, consecutive_skips)
                row = self._metrics_row(out, lr, elapsed, self.plan.input_tokens_per_step,
                                       flops_per_step, peak)
                for straggler in self.stragglers.add(self.step, out.compute_s):
                    self.warn(straggler.line(self.step))
                    if writer:
                        writer.write_event(straggler.row(self.step))
                if self.tuner is not None:
                    self._retune(elapsed, out.compute_s, row["mem_peak_bytes"], writer)
                if cfg.model.is_moe:
                    row.update(step_routing_stats(self.model.moe_layers(), cfg.model, self.mesh,
                                                  tokens_per_step, update_bias=not out.skipped,
                                                  device=self.device))
                if cfg.model.mtp_depth:
                    row.update(self.model.mtp_losses.step_metrics(self.mesh, tokens_per_step,
                                                                  self.device))
                last = self.step == t.steps
                if t.eval_every and (self.step % t.eval_every == 0 or last):
                    phase(f"the validation at step {self.step}")
                    result.val_loss = self.validation_loss()
                    row.update(val_loss=result.val_loss, val_ppl=math.exp(result.val_loss))
                    if t.eval_generate:
                        self._sample(writer)
                if writer and (self.step % t.log_every == 0 or last or "val_loss" in row):
                    writer.write(row)
                    progress.clear()
                    self.log(format_row(row, t.steps))
                progress.update(self.step, out.loss, row["tokens_per_s"])
                every = cfg.checkpoint.every
                if (every and self.step % every == 0) or last or self._time_to_save(last_save):
                    phase(f"saving the checkpoint of step {self.step}")
                    result.checkpoint = self.save()
                    last_save = time.monotonic()
                if self.tuner is not None and self.tuner.retuner.restart is not None:
                    result.relayout = self._relayout(result)
                    break
            phase("waiting for the last save of every rank")
            self.finish_saving()
        finally:
            if watchdog:
                watchdog.stop()
            progress.clear()
            if writer:
                writer.close()
        result.end_step = self.step
        if self.is_rank0 and cfg.run.plot:
            try:
                plot_runs([self.run_dir], self.run_dir / "loss.png")
            except MeshtronError as err:  # e.g. every logged loss was skipped as NaN
                self.warn(f"no loss.png: {err}")
        return result

    def _retune(self, step_s: float, compute_s: float, memory: int,
                writer: MetricsWriter | None) -> None:
        """``train.autotune``: a window's decisions, logged; a new micro-batch size applies
        from the next step (a pipeline gets the schedule of its new micro-batch count)."""
        for event in self.tuner.after_step(self.step, step_s, compute_s, memory):
            self.log(describe(event))
            if writer:
                writer.write_event(event)
        plan = self.tuner.plan
        if plan.micro_batch != self.micro_batch:
            self.micro_batch = plan.micro_batch
            if self.pipeline is not None:
                self.pipeline = PipelineExecutor(self.model, self.mesh, plan.partition,
                                                 plan.schedule, self.cfg.model.hidden_size)

    def _relayout(self, result: TrainResult) -> Path:
        """Checkpoint this step (unless just saved) and write what was chosen (rank 0)."""
        if result.checkpoint is None or result.checkpoint.name != step_dir_name(self.step):
            result.checkpoint = self.save()
        if self.is_rank0:
            write_chosen_layout(self.run_dir, self.step, self.tuner.retuner.restart)
        return self.run_dir / LAYOUT_FILE

    def _check_skips(self, out: StepResult, consecutive: int) -> None:
        """A skipped step (agreed by every rank) is said; ``train.max_skipped`` in a row stop
        the run. fp16 with loss scaling skips as part of finding its scale: said only when
        the limit is reached."""
        cfg = self.cfg
        what = (f"loss {out.loss}" if not math.isfinite(out.loss)
                else f"grad norm {out.grad_norm}")
        if self.precision.scaler is None:
            self.warn(f"step {self.step} skipped on every rank: {what}; the weights and "
                      "optimizer state are unchanged")
        if consecutive >= cfg.train.max_skipped:
            raise too_many_skips(cfg, self.precision.scaler is not None, consecutive, self.step,
                                 what)

    def _time_to_save(self, last_save: float) -> bool:
        """``checkpoint.every_seconds`` has passed since the last save, by rank 0's clock
        (one tiny broadcast a step, so every rank saves at the same step)."""
        limit = self.cfg.checkpoint.every_seconds
        if limit <= 0:
            return False
        due = torch.tensor([float(time.monotonic() - last_save >= limit)])
        if self.mesh.world.pg is not None:
            torch.distributed.broadcast(due, src=0, group=self.mesh.world.pg)
        return bool(due.item())

    def _metrics_row(self, out: StepResult, lr: float, elapsed: float, tokens: int,
                     flops: float, peak: float) -> dict:
        return {
            "step": self.step, "loss": out.loss, "lr": lr, "grad_norm": out.grad_norm,
            "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
            "mem_peak_bytes": peak_memory_bytes(self.device),
            "mfu": flops / elapsed / (peak * self.mesh.layout.world_size),
            "skipped": out.skipped, "skipped_steps": self.skipped_steps,
            "compute_s": out.compute_s, "comm_bytes": self.mesh.stats.take(),
        }


def _layout_text(sizes: dict) -> str:
    return " ".join(f"{axis}={size}" for axis, size in sizes.items())


def train(cfg: Config, mesh: ParallelMesh | None = None, log: Log = print,
          device: torch.device | None = None, *,
          checked: bool = False) -> TrainResult:
    """Train per ``cfg`` (resuming when a checkpoint exists) and return a summary."""
    trainer = Trainer(cfg, mesh, log, device, checked=checked)
    result = trainer.run()
    sys.stdout.flush()
    return result
