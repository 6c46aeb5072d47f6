"""Published, measured training runs: the outside check of the cost model.

``published_runs.yaml`` (beside this module) holds runs that large clusters measured and
published (Megatron-LM, TorchTitan, Megatron-Bridge, the Llama 3 paper), each with its source,
hardware, model, layout and recipe as published, and the figure measured. Loading validates
every field and names a wrong one in one line, so a typo in the file is never a silent
mis-comparison. Each run is turned into the cost model's own inputs (a :class:`Problem` and a
pinned :class:`Candidate`) and its measurement into tokens per second per GPU, the one figure
that needs no FLOP convention (:mod:`meshtron.costmodel.against_published` compares them).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from meshtron.config import ModelConfig
from meshtron.config.sections import FP8_RECIPES
from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.priced import Software
from meshtron.costmodel.problem import Problem
from meshtron.costmodel.profiles import builtin_profiles
from meshtron.costmodel.recompute import SELECTIVE_STYLES
from meshtron.errors import MeshtronError

RUNS_FILE = Path(__file__).with_name("published_runs.yaml")
FIELDS = ("name", "source", "hardware", "hardware_changes", "gpus", "model", "seq_len",
          "global_batch", "micro_batch", "recompute", "layout", "precision", "software",
          "measured", "assumed", "notes")
REQUIRED = ("name", "source", "hardware", "gpus", "model", "seq_len", "global_batch",
            "micro_batch", "recompute", "layout", "precision", "measured")
LAYOUT = ("tp", "cp", "pp", "vpp", "schedule", "ep", "etp", "zero", "sp", "pp_layers")
SOFTWARE = tuple(f.name for f in dataclasses.fields(Software))
MEASURES = ("step_time_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu",
            "recompute_tflops_per_gpu")
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-v")
HARDWARE_CHANGES = ("memory_bytes", "memory_bandwidth", "bf16_tflops")
UNPUBLISHED_PEAKS = ("h100-hbm2e",)
"""Built-in profiles whose peak no data sheet gives (an upper bound stands in)."""


@dataclass(frozen=True)
class PublishedRun:
    """One published run, as the cost model reads it."""

    name: str
    url: str
    where: str
    hardware: str
    gpus: int
    model: ModelConfig
    problem: Problem
    candidate: Candidate
    measure: str
    value: float
    assumed: tuple[str, ...]
    software: Software = Software()
    pp_layers: tuple[float, ...] | None = None
    data_sheet: bool = True
    """Whether the hardware is a data sheet's: a built-in profile as it is (no
    ``hardware_changes``) whose peak is published (not in :data:`UNPUBLISHED_PEAKS`)."""

    @property
    def moe(self) -> bool:
        return self.model.is_moe

    @property
    def generation(self) -> str:
        """The GPU's generation: what "its class" means for published figures."""
        return generation_of(self.hardware)

    def measured_tokens_per_s_per_gpu(self) -> float:
        """The measurement as tokens per second per GPU, through the source's own FLOP count
        where it published FLOP/s."""
        tokens = self.problem.global_batch * self.problem.seq_len
        if self.measure == "tokens_per_s_per_gpu":
            return self.value
        if self.measure == "step_time_s":
            return tokens / self.value / self.gpus
        flops = (self.problem.flops_per_step if self.measure == "model_tflops_per_gpu"
                 else narayanan_flops(self.model, self.problem.seq_len,
                                      self.problem.global_batch))
        return tokens * self.value * 1e12 / flops

    def measured_mfu(self) -> float:
        """Model FLOPs per second per GPU over the dtype's dense peak (FP8 runs too, as their
        sources count them)."""
        flops = self.problem.flops_per_step / (self.problem.global_batch * self.problem.seq_len)
        return (self.measured_tokens_per_s_per_gpu() * flops
                / self.problem.profile.peak(self.problem.dtype))


def generation_of(profile_name: str) -> str:
    """a100-40gb and a100-80gb are 'a100'; h100-sxm and h200 (the same tensor cores) 'h100'."""
    return {"h200": "h100"}.get(profile_name, profile_name.split("-")[0])


def narayanan_flops(cfg: ModelConfig, seq_len: int, batch: int) -> float:
    """FLOPs of one step as Narayanan et al. (2021) count them, full recomputation's forward
    included: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    h, layers = cfg.hidden_size, cfg.num_layers
    return 96.0 * batch * seq_len * layers * h * h * (
        1 + seq_len / (6 * h) + cfg.vocab_size / (16 * layers * h))


def _fail(where: str, what: str) -> MeshtronError:
    return MeshtronError(f"published runs {where}: {what}")


def _whole(raw: dict, key: str, where: str, low: int = 1) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _fail(where, f"'{key}' must be a whole number >= {low}, got {value!r}")
    return value


def _positive(raw: dict, key: str, where: str) -> float:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise _fail(where, f"'{key}' must be a positive number, got {value!r}")
    return float(value)


def _model(raw: object, where: str) -> ModelConfig:
    from meshtron.config import load_config

    if not isinstance(raw, dict) or not raw:
        raise _fail(where, "'model' must map model fields (a preset and/or --model.FIELD "
                           "values)")
    overrides = [f"--model.{k}={str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in raw.items()]
    try:
        return load_config(None, overrides).model
    except MeshtronError as err:
        raise _fail(where, f"'model': {err}") from None


def _candidate(raw: dict, layout: object, gpus: int, where: str) -> Candidate:
    if not isinstance(layout, dict) or set(layout) - set(LAYOUT):
        raise _fail(where, f"'layout' must map {', '.join(LAYOUT)}")
    sizes = {k: _whole(layout, k, f"{where} layout") for k in ("tp", "cp", "pp", "vpp", "ep")}
    zero = _whole(layout, "zero", f"{where} layout", low=0)
    if zero > 3:
        raise _fail(where, f"layout 'zero' must be 0-3, got {zero}")
    if layout.get("schedule") not in SCHEDULES:
        raise _fail(where, f"layout 'schedule' must be one of {', '.join(SCHEDULES)}, got "
                           f"{layout.get('schedule')!r}")
    if not isinstance(layout.get("sp"), bool):
        raise _fail(where, f"layout 'sp' must be true or false, got {layout.get('sp')!r}")
    etp = layout.get("etp")
    if etp not in (None, 1):
        raise _fail(where, f"layout 'etp' must be 1 or left out, got {etp!r}")
    split = sizes["tp"] * sizes["cp"] * sizes["pp"]
    if gpus % split:
        raise _fail(where, f"tp x cp x pp = {split} does not divide the {gpus} GPUs")
    if raw["recompute"] not in ("none", "selective", "full"):
        raise _fail(where, f"'recompute' must be none, selective or full, got "
                           f"{raw['recompute']!r}")
    return Candidate(tp=sizes["tp"], cp=sizes["cp"], pp=sizes["pp"], vpp=sizes["vpp"],
                     schedule=layout["schedule"], ep=sizes["ep"], etp=etp, dp=gpus // split,
                     zero=zero, sp=layout["sp"],
                     micro_batch=_whole(raw, "micro_batch", where), recompute=raw["recompute"])


def _problem(raw: dict, model: ModelConfig, gpus: int, where: str) -> Problem:
    profiles = builtin_profiles()
    if raw["hardware"] not in profiles:
        raise _fail(where, f"unknown hardware {raw['hardware']!r} (built-in profiles: "
                           f"{', '.join(profiles)})")
    changes = raw.get("hardware_changes") or {}
    if not isinstance(changes, dict) or set(changes) - set(HARDWARE_CHANGES):
        raise _fail(where, f"'hardware_changes' may set {', '.join(HARDWARE_CHANGES)}")
    profile = profiles[raw["hardware"]]
    if "bf16_tflops" in changes:  # the dense peaks scale with the clock the part runs at
        ratio = _positive(changes, "bf16_tflops", where) * 1e12 / profile.peak("bf16")
        profile = dataclasses.replace(profile, peak_flops={
            k: v * ratio if k in ("bf16", "fp16", "fp8", "fp4") else v
            for k, v in profile.peak_flops.items()})
    profile = dataclasses.replace(profile, **{
        k: (int if k == "memory_bytes" else float)(_positive(changes, k, where))
        for k in changes if k != "bf16_tflops"})
    precision = raw["precision"]
    if not isinstance(precision, dict) \
            or set(precision) - {"dtype", "fp8", "tp_comm_chunks", "reduce_dtype"}:
        raise _fail(where, "'precision' must map dtype, fp8, reduce_dtype and tp_comm_chunks")
    if precision.get("reduce_dtype", "fp32") not in ("fp32", "bf16", "fp16"):
        raise _fail(where, f"precision 'reduce_dtype' must be fp32, bf16 or fp16, got "
                           f"{precision.get('reduce_dtype')!r}")
    if precision.get("dtype") not in ("bf16", "fp16"):
        raise _fail(where, f"precision 'dtype' must be bf16 or fp16, got "
                           f"{precision.get('dtype')!r}")
    fp8 = precision.get("fp8", "none")
    if fp8 not in FP8_RECIPES:
        raise _fail(where, f"precision 'fp8' must be one of {', '.join(FP8_RECIPES)}, got "
                           f"{fp8!r}")
    chunks = _whole(precision, "tp_comm_chunks", where, low=0) \
        if "tp_comm_chunks" in precision else 0
    return Problem(model, _whole(raw, "seq_len", where), _whole(raw, "global_batch", where),
                   profile, gpus, dtype=precision["dtype"], fp8=fp8 != "none",
                   reduce_dtype=precision.get("reduce_dtype", "fp32"), tp_comm_chunks=chunks)


def _software(raw: object, where: str) -> Software:
    if raw is None:
        return Software()
    valued = ("attention_efficiency", "selective", "selective_every")
    if not isinstance(raw, dict) or set(raw) - set(SOFTWARE) or not all(
            isinstance(v, bool) for k, v in raw.items() if k not in valued):
        raise _fail(where, f"'software' must map {', '.join(SOFTWARE)} (true or false; "
                           "attention_efficiency a fraction of peak)")
    if "attention_efficiency" in raw and not 0 < _positive(raw, "attention_efficiency",
                                                           where) <= 1:
        raise _fail(where, "software 'attention_efficiency' must be in (0, 1]")
    if raw.get("selective", "core") not in SELECTIVE_STYLES:
        raise _fail(where, f"software 'selective' must be one of {', '.join(SELECTIVE_STYLES)}"
                           f", got {raw.get('selective')!r}")
    if "selective_every" in raw:
        _whole(raw, "selective_every", f"{where} software")
    return Software(**raw)


def _pp_layers(layout: dict, where: str) -> tuple[float, ...] | None:
    split = layout.get("pp_layers")
    if split is None:
        return None
    stages = layout["pp"] * layout["vpp"]
    if not isinstance(split, list) or len(split) != stages or not all(
            isinstance(n, (int, float)) and not isinstance(n, bool) for n in split):
        raise _fail(where, f"layout 'pp_layers' must list the layers of each of the pp x vpp "
                           f"= {stages} virtual stages")
    return tuple(float(n) for n in split)


def _measured(raw: object, where: str) -> tuple[str, float]:
    if not isinstance(raw, dict) or len(raw) != 1 or next(iter(raw)) not in MEASURES:
        raise _fail(where, f"'measured' must give exactly one of {', '.join(MEASURES)}")
    key = next(iter(raw))
    return key, _positive(raw, key, where)


def run_of(raw: object, index: int, path: Path) -> PublishedRun:
    """One entry of the file, validated (``index`` names it while its name is unknown)."""
    if not isinstance(raw, dict):
        raise _fail(f"{path.name} run {index + 1}", "must be a mapping of fields")
    where = f"{path.name} run {index + 1}"
    if isinstance(raw.get("name"), str) and raw["name"]:
        where = f"{path.name} run '{raw['name']}'"
    if unknown := sorted(set(raw) - set(FIELDS)):
        raise _fail(where, f"unknown field '{unknown[0]}' (fields: {', '.join(FIELDS)})")
    if missing := [k for k in REQUIRED if k not in raw]:
        raise _fail(where, f"missing field '{missing[0]}'")
    source = raw["source"]
    if not isinstance(source, dict) or not all(isinstance(source.get(k), str) and source[k]
                                               for k in ("url", "where")) \
            or not source["url"].startswith("https://"):
        raise _fail(where, "'source' must give 'url' (https://...) and 'where' (the table or "
                           "section)")
    gpus = _whole(raw, "gpus", where)
    model = _model(raw["model"], where)
    problem = _problem(raw, model, gpus, where)
    candidate = _candidate(raw, raw["layout"], gpus, where)
    if problem.global_batch % (candidate.dp * candidate.micro_batch):
        raise _fail(where, f"global_batch {problem.global_batch} does not split into "
                           f"{candidate.dp} data-parallel ranks of micro-batches of "
                           f"{candidate.micro_batch}")
    measure, value = _measured(raw["measured"], where)
    assumed = raw.get("assumed") or []
    if not isinstance(assumed, list) or not all(isinstance(a, str) for a in assumed):
        raise _fail(where, "'assumed' must be a list of sentences")
    return PublishedRun(raw["name"], source["url"], source["where"], raw["hardware"], gpus,
                        model, problem, candidate, measure, value, tuple(assumed),
                        _software(raw.get("software"), where), _pp_layers(raw["layout"], where),
                        not raw.get("hardware_changes")
                        and raw["hardware"] not in UNPUBLISHED_PEAKS)


def load_published_runs(path: Path = RUNS_FILE) -> list[PublishedRun]:
    """Every run of the file, validated; a wrong field is named in one line."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise MeshtronError(f"cannot read published runs {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise MeshtronError(f"published runs {path} is not valid YAML: "
                            f"{str(err).splitlines()[0]}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("runs"), list) or not raw["runs"]:
        raise MeshtronError(f"published runs {path}: must hold a non-empty list 'runs'")
    runs = [run_of(entry, i, path) for i, entry in enumerate(raw["runs"])]
    names = [r.name for r in runs]
    if dup := next((n for n in names if names.count(n) > 1), None):
        raise MeshtronError(f"published runs {path}: the name '{dup}' is used twice")
    return runs
