"""The configs hpsearch trials run: the user's config at a proxy width, with a trial's settings.

Trials must be comparable, so a trial's settings bring their consequences with them: a
searched ``train.global_batch`` keeps the token budget of the config (steps, and warm-up, which
is given in steps of the config's batch, scale inversely with the batch); a searched
``train.lr`` keeps the config's ratio of ``train.min_lr`` to it (the schedule's floor would
otherwise be above some learning rates); every trial ends with an evaluation on the same
validation sequences. A proxy at width ``w`` sets ``model.hidden_size = w`` and scales the
FFN (and an explicit head width or the experts' FFN) in proportion, keeping the head count:
the attention multiplier of ``model.mup`` assumes the heads widen, not multiply
(docs/training.md).

Every config is made by the path ``meshtron train`` takes (``load_config`` with overrides,
then ``plan.check_run``), so what the search refuses is what training would refuse.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtron.config import Config, load_config
from meshtron.errors import MeshtronError
from meshtron.hpsearch.space import Dimension, format_value, with_choices
from meshtron.plan import check_run

WIDTH_FIELDS = ("model.hidden_size", "model.ffn_hidden_size", "model.head_dim",
                "model.moe.expert_ffn_size")
"""Fields a proxy width sets: they cannot also be searched."""


@dataclass(frozen=True)
class WidthProxy:
    """The user's run (``config_path`` + ``overrides``, resolved as ``base``) at ``width``
    (None: as configured) on ``nproc`` ranks."""

    config_path: str | None
    overrides: tuple[str, ...]
    base: Config
    width: int | None = None
    nproc: int = 1

    @property
    def label(self) -> str:
        return f"width {self.width}" if self.width else "the config's model"

    def model_settings(self) -> dict[str, Any]:
        """The model fields of this width, scaled from the config's model."""
        m = self.base.model
        if self.width is None or self.width == m.hidden_size:
            return {}
        ratio = self.width / m.hidden_size
        out: dict[str, Any] = {"model.hidden_size": self.width,
                               "model.ffn_hidden_size": max(1, round(m.ffn_hidden_size * ratio))}
        if m.head_dim:
            out["model.head_dim"] = max(1, round(m.head_dim * ratio))
        if m.is_moe:
            out["model.moe.expert_ffn_size"] = max(1, round(m.moe.expert_ffn_size * ratio))
        return out

    def settings(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """A trial's parameters with what follows from them (batch: steps and warm-up at a
        fixed token budget; learning rate: the floor of the schedule at the same ratio)."""
        t = self.base.train
        out = dict(params)
        batch = params.get("train.global_batch", t.global_batch)
        if batch != t.global_batch:
            scale = t.global_batch / batch
            out.setdefault("train.steps", max(1, round(t.steps * scale)))
            out["train.warmup_steps"] = round(params.get("train.warmup_steps", t.warmup_steps)
                                              * scale)
        if "train.lr" in params and "train.min_lr" not in params:
            out["train.min_lr"] = params["train.lr"] * t.min_lr / t.lr
        return out

    def config(self, params: Mapping[str, Any]) -> Config:
        """The config of these parameters at this width, checked as ``meshtron train`` would
        check it on ``nproc`` ranks."""
        values = {**self.model_settings(), **self.settings(params)}
        cfg = load_config(self.config_path, [*self.overrides, *as_overrides(values)])
        check_run(cfg, self.nproc)
        return cfg

    def trial_config(self, params: Mapping[str, Any], run_dir: Path) -> Config:
        """The run of one trial: every step logged (the pruner reads them), one evaluation at
        the end over the config's validation sequences, no checkpoint but the trainer's last,
        nothing else that costs time or prints (a nominal ``peak_flops`` skips the CPU's
        start-up matmul probe: a trial's MFU is not read)."""
        cfg = self.config(params)
        t = cfg.train
        sequences = self.base.train.eval_batches * self.base.train.global_batch
        train = dataclasses.replace(t, log_every=1, eval_every=t.steps, eval_generate=0,
                                    eval_batches=max(1, round(sequences / t.global_batch)),
                                    peak_flops=t.peak_flops or 1e12)
        return dataclasses.replace(
            cfg, train=train,
            checkpoint=dataclasses.replace(cfg.checkpoint, dir=None, every=0,
                                           every_seconds=0.0, keep_last=1, async_=False,
                                           resume=False),
            run=dataclasses.replace(cfg.run, dir=str(run_dir), progress=False, plot=False,
                                    straggler_every=0, wandb="off"))

    def fingerprint(self) -> dict[str, Any]:
        """What decides this proxy's losses besides the searched fields (a resumed study
        must have been run with the same)."""
        return {k: v for k, v in self.config({}).to_dict().items()
                if k not in ("run", "checkpoint")}

    def units(self, step: int, batch: int) -> int:
        """Steps of the config's batch that ``step`` steps of ``batch`` sequences are worth
        (the pruner's resource: the same tokens whatever the batch)."""
        return step * batch // self.base.train.global_batch


def as_overrides(values: Mapping[str, Any]) -> list[str]:
    """``--section.field=value`` with the value in YAML (JSON is YAML) so types survive."""
    return [f"--{name}={json.dumps(value)}" for name, value in values.items()]


def proxies(config_path: str | None, overrides: Sequence[str], widths: Sequence[int],
            nproc: int) -> list[WidthProxy]:
    """One proxy per width (or the config's own model), each checked before any trial."""
    base = load_config(config_path, overrides)
    out = [WidthProxy(config_path, tuple(overrides), base, w, nproc) for w in widths or [None]]
    for proxy in out:
        try:
            proxy.config({})
        except MeshtronError as err:
            raise MeshtronError(f"--widths {proxy.width}: {err}" if proxy.width else str(err)) \
                from None
    return out


def prune_space(dims: Sequence[Dimension], runs: Sequence[WidthProxy]
                ) -> tuple[list[Dimension], list[str]]:
    """Drop the choices no proxy can run, saying why; a range whose ends cannot run, or a
    dimension with no choice left, is one error line."""
    widths = [p.width for p in runs if p.width]
    for dim in dims:
        if dim.name in WIDTH_FIELDS and widths:
            raise MeshtronError(f"--space {dim.name}: --widths sets it; search other fields")
    kept, notes = [], []
    for dim in dims:
        values = dim.choices if dim.kind == "choice" else (dim.low, dim.high)
        if dim.kind == "int":
            values = (int(dim.low), int(dim.high))
        refused = {v: why for v in values if (why := _refusal(dim.name, v, runs))}
        if dim.kind != "choice" and refused:
            end, why = next(iter(refused.items()))
            raise MeshtronError(f"--space {dim.describe()}: {format_value(end)} cannot run: "
                                f"{why}")
        left = [v for v in values if v not in refused]
        if not left:
            reasons = "; ".join(f"{format_value(v)}: {why}" for v, why in refused.items())
            raise MeshtronError(f"the search space is empty after pruning: no value of "
                                f"{dim.name} can run ({reasons})")
        notes += [f"space: dropped {dim.name}={format_value(v)} ({why})"
                  for v, why in refused.items()]
        kept.append(with_choices(dim, left) if dim.kind == "choice" else dim)
    return kept, notes


def _refusal(name: str, value: Any, runs: Sequence[WidthProxy]) -> str | None:
    for proxy in runs:
        try:
            proxy.config({name: value})
        except MeshtronError as err:
            return str(err) + (f" at width {proxy.width}" if proxy.width else "")
    return None
