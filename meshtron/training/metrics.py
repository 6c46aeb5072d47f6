"""Run-directory outputs: ``metrics.jsonl`` (one JSON object per logged step) and TensorBoard.

Only global rank 0 creates a writer; other ranks pass ``None`` around instead.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

from meshtron.errors import MeshtronError
from meshtron.files import os_reason

REQUIRED_FIELDS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s",
                   "mem_peak_bytes")


class MetricsWriter:
    """Rows to ``metrics.jsonl``, their numbers to TensorBoard and, with ``wandb`` (the
    ``run.wandb`` mode, project and the run's config), to Weights & Biases."""

    def __init__(self, run_dir: Path, wandb: tuple[str, str, dict] | None = None):
        from torch.utils.tensorboard import SummaryWriter  # heavy import: only on rank 0

        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._jsonl = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))
        self._wandb = _wandb_run(run_dir, *wandb) if wandb else None

    def write(self, row: dict[str, Any]) -> None:
        missing = [k for k in REQUIRED_FIELDS if k not in row]
        assert not missing, f"metrics row lacks {missing}"
        try:
            self._jsonl.write(json.dumps(row) + "\n")
            step = int(row["step"])
            scalars = dict(_scalars(row))
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            if self._wandb is not None:
                self._wandb.log(scalars, step=step)
        except OSError as err:
            raise MeshtronError(f"cannot write the metrics of step {row['step']} to "
                                f"{self.path.parent} ({os_reason(err)})") from None

    def write_text(self, tag: str, text: str, step: int) -> None:
        """A text sample (``train.eval_generate``) to TensorBoard."""
        self._tb.add_text(tag, text, step)

    def write_event(self, row: dict[str, Any]) -> None:
        """A row that is not a step's metrics (``{"event": "straggler", ...}``)."""
        try:
            self._jsonl.write(json.dumps(row) + "\n")
        except OSError as err:
            raise MeshtronError(f"cannot write an event to {self.path} ({os_reason(err)})") \
                from None
        name = row["event"]
        for key, value in _scalars(row):
            if key not in ("event", "step"):
                self._tb.add_scalar(f"{name}/{key}", value, row.get("step"))
        if self._wandb is not None:
            self._wandb.log({f"{name}/{key}": value for key, value in _scalars(row)
                             if key != "event"}, step=row.get("step"))

    def close(self) -> None:
        with contextlib.suppress(OSError):  # a refused write was reported by write()
            self._jsonl.close()
        self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_run(run_dir: Path, mode: str, project: str, config: dict):
    """A Weights & Biases run in ``run_dir`` (offline: files only, no network)."""
    try:
        import wandb
    except ImportError:
        raise MeshtronError(f"run.wandb={mode} needs the wandb package: pip install "
                            "'meshtron[wandb]' (or set run.wandb=off)") from None
    return wandb.init(project=project, name=run_dir.name, dir=str(run_dir), mode=mode,
                      config=config, settings=wandb.Settings(silent=True))


def _scalars(row: dict[str, Any], prefix: str = ""):
    """Finite numbers of a row, nested dicts flattened to 'outer/inner' names."""
    for key, value in row.items():
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/")
        elif key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
            yield prefix + key, value


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """All JSON-object rows of a run's ``metrics.jsonl``; a line that is not one (a torn last
    line from a crash mid-write, garbage, JSON nested too deeply to parse) is skipped."""
    rows = []
    path = run_dir / "metrics.jsonl"
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except (json.JSONDecodeError, RecursionError):
                    continue
    except UnicodeDecodeError:
        raise MeshtronError(f"{path} is not a metrics file (not UTF-8 text)") from None
    return [row for row in rows if isinstance(row, dict)]


def format_row(row: dict, total: int) -> str:
    text = (f"step {row['step']:>{len(str(total))}}/{total} | loss {row['loss']:.4f} | "
            f"lr {row['lr']:.2e} | grad {row['grad_norm']:.3f} | "
            f"{row['tokens_per_s']:,.0f} tok/s | mfu {100 * row['mfu']:.1f}%")
    if "moe/load_max_over_mean" in row:
        text += (f" | moe load max/mean {row['moe/load_max_over_mean']:.2f}, dropped "
                 f"{100 * row['moe/dropped_fraction']:.1f}%")
    if "val_loss" in row:
        text += f" | val {row['val_loss']:.4f} (ppl {row['val_ppl']:.1f})"
    return text
