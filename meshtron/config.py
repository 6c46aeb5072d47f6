"""Configuration: one dataclass per section, YAML files, dotted overrides, validation.

A config is built in three steps:

1. defaults from the dataclasses below, then a YAML file (``--config``), then
   ``--section.field=value`` overrides, each checked for unknown names and wrong types;
2. :func:`resolve` fills what was left unset (model shape from ``model.preset``, micro batch
   from the global batch) so the written ``config.yaml`` states every value that was used;
3. :func:`validate` rejects impossible combinations with one sentence each.

Every problem raises :class:`~meshtron.errors.MeshtronError`; nothing here touches torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from meshtron.errors import MeshtronError
from meshtron.models.presets import MODEL_PRESETS
from meshtron.parallel.layout import expert_fold_message

ARCHS = ("llama", "gpt2")
DTYPES = ("fp32", "bf16", "fp16")
REDUCE_DTYPES = ("fp32", "bf16")
FP8_RECIPES = ("none", "tensorwise", "delayed", "blockwise")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
RECOMPUTE = ("none", "selective", "full")
ROUTER_SCORES = ("softmax", "sigmoid")
AUX_LOSS_SCOPES = ("micro_batch", "sequence")
EXPERT_COMPUTE = ("grouped", "loop")


@dataclass
class MoEConfig:
    """Mixture of experts (``model.moe.*``); ``num_experts`` 0 keeps every MLP dense. Unset
    fields (None) come from the preset, then from the defaults in :data:`MOE_DEFAULTS`."""

    num_experts: int | None = None
    top_k: int | None = None
    expert_ffn_size: int | None = None
    """Hidden units of one expert (fine-grained experts are narrower); None: ffn_hidden_size."""
    shared_experts: int | None = None
    """Always-on experts (DeepSeek), computed as one dense MLP of shared x expert_ffn_size."""
    dense_layers: int | None = None
    """The first this many layers keep a dense MLP."""
    every: int | None = None
    """After the dense layers, every this-many-th layer is MoE (1: all of them)."""
    score: str | None = None
    """Router scores: softmax or sigmoid."""
    normalize_topk: bool | None = None
    """Rescale the chosen experts' weights to sum to one."""
    route_scale: float | None = None
    """Multiplier of the routing weights."""
    groups: int | None = None
    """Group-limited routing (DeepSeek-V3): experts form this many groups ..."""
    topk_groups: int | None = None
    """... and each token chooses its experts inside its best this-many groups."""
    aux_loss: float | None = None
    """Coefficient of the load-balancing loss (Switch/GShard form); 0 disables."""
    aux_loss_scope: str | None = None
    """Balance over each micro_batch or each sequence."""
    z_loss: float | None = None
    """Coefficient of the router z-loss (mean squared logsumexp of the logits)."""
    bias_update: float | None = None
    """Aux-loss-free balancing: per-expert selection bias moved by this much per step towards
    the mean load (DeepSeek-V3's gamma); 0 disables."""
    capacity_factor: float | None = None
    """Tokens an expert takes per micro-batch, as a multiple of the balanced share; 0: dropless."""
    pad_to_capacity: bool | None = None
    """With a capacity: every expert computes exactly its capacity (padding with zeros)."""
    compute: str | None = None
    """Expert FFNs as one grouped matmul (grouped) or one matmul per expert (loop)."""


MOE_DEFAULTS: dict[str, Any] = dict(
    num_experts=0, top_k=2, shared_experts=0, dense_layers=0, every=1, score="softmax",
    normalize_topk=True, route_scale=1.0, groups=1, topk_groups=1, aux_loss=0.01,
    aux_loss_scope="micro_batch", z_loss=0.0, bias_update=0.0, capacity_factor=0.0,
    pad_to_capacity=False, compute="grouped",
)


@dataclass
class ModelConfig:
    """Model shape. Unset fields (None) come from ``preset``; explicit values win."""

    preset: str = "tiny"
    arch: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int | None = None
    """Vocabulary size; None takes the tokenizer's."""
    vocab_multiple: int = 128
    """The embedding is padded to a multiple of this, identically under every layout."""
    max_seq_len: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    init_std: float = 0.02
    dropout: float = 0.0
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe.num_experts)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (global index) has experts in place of its MLP."""
        moe = self.moe
        return (self.is_moe and layer >= moe.dense_layers
                and (layer - moe.dense_layers) % moe.every == 0)


@dataclass
class ParallelConfig:
    """How the world is split. dp is derived: world_size / (tp * cp * pp)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    """Expert tensor parallelism: experts split over tp like the MLP (None: tp), or 1: whole
    experts, each tp rank routing its own share of the tokens (ep then folds over tp too)."""
    vpp: int = 1
    sp: bool = False
    zero: int = 0
    """ZeRO stage: 0 replicates optimizer state, 1 shards it over dp, 2 also gradients."""
    bucket_mb: float = 25.0
    """Gradients are reduced in buckets of about this many MiB, overlapping backward."""
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved (needs vpp >= 2) or zb-h1."""
    pp_layers: list[int] | None = None
    """Layers per virtual pipeline stage (pp * vpp counts in model order); unset: balanced."""


@dataclass
class TrainConfig:
    steps: int = 200
    global_batch: int = 8
    """Sequences per optimizer step, summed over micro-batches and data-parallel ranks."""
    micro_batch: int | None = None
    """Sequences per forward pass per rank; None means global_batch / dp (no accumulation)."""
    seq_len: int = 256
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Clip the global grad norm to this value; 0 disables clipping."""
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 100
    """Evaluate on the validation split every this many steps (and at the end); 0 disables."""
    eval_batches: int = 4
    recompute: str = "none"
    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU; None looks it up (GPUs) or measures it (CPU)."""


@dataclass
class DataConfig:
    path: list[str] | None = None
    """Raw text (.txt, folder, .jsonl) or indexed-dataset prefixes; 'w:path' entries blend."""
    cache_dir: str = "~/.cache/meshtron"
    tokenizer: str | None = None
    """A tokenizer.json to use; None trains a byte-level BPE on the training text."""
    vocab_size: int = 8192
    """Vocabulary size of a tokenizer trained here."""
    valid_fraction: float = 0.02
    corpus_max_mb: float = 8.0
    """Size cap of the embedded default corpus (the standard library's sources)."""


@dataclass
class PrecisionConfig:
    dtype: str = "fp32"
    """Parameters and activations: fp32, or bf16/fp16 with fp32 master weights."""
    reduce_dtype: str = "fp32"
    """Gradient buckets and their data-parallel reduction: fp32, or bf16 (half the bytes)."""
    loss_scaling: bool = True
    """Dynamic loss scaling under fp16 (an overflow without it stops training)."""
    fp8: str = "none"
    """FP8 for the blocks' linear layers: none, tensorwise, delayed or blockwise scaling."""
    fp8_grad: str = "e5m2"
    """FP8 format of output gradients: e5m2 or e4m3 (activations and weights are e4m3)."""
    fp8_block: int = 128
    """Block size of blockwise scaling (1 x block activation tiles, block x block weights)."""
    fp8_history: int = 1024
    """Delayed scaling: steps of amax history."""
    fp8_amax: str = "max"
    """Delayed scaling: the scale comes from the history's max or its most_recent amax."""


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Where checkpoints go; None means <run.dir>/checkpoints."""
    every: int = 0
    """Save every this many steps; 0 saves only at the end."""
    keep_last: int = 3
    resume: bool = True
    """Resume from the newest complete checkpoint in checkpoint.dir when there is one."""
    async_: bool = False
    """``checkpoint.async``: copy the state to host memory and write it while training goes
    on (at most one save in flight; a failed save is reported at the next step)."""


@dataclass
class RunConfig:
    dir: str = "runs/default"
    progress: bool = True
    """Show a live progress bar on stderr."""
    plot: bool = True
    """Write loss.png into the run directory at the end."""
    timeout_s: float = 600.0
    """How long a rank waits in a collective before giving up (a peer died or hangs)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {section: {config_key(k): v for k, v in values.items()}
                for section, values in dataclasses.asdict(self).items()}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir or Path(self.run.dir) / "checkpoints")


SECTIONS: dict[str, type] = typing.get_type_hints(Config)


def config_key(attr: str) -> str:
    """A field's name in YAML and overrides (``async_`` is ``async``: Python keywords cannot
    be attribute names)."""
    return attr[:-1] if attr.endswith("_") and keyword.iskeyword(attr[:-1]) else attr


def _attr(key: str) -> str:
    return f"{key}_" if keyword.iskeyword(key) else key


# ----------------------------------------------------------------------------- parsing


def _suggest(name: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a YAML- or CLI-parsed value to the annotated type, or explain why not."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(v, item_tp, where) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise MeshtronError(f"{where}: expected {_type_name(tp)}, got {value!r}")


def _set_field(cfg: Any, section: str, key: str, value: Any) -> None:
    """Set ``section.key`` of ``cfg``; ``key`` may be dotted into a nested section
    (``model.moe.top_k``), and a mapping value sets a nested section field by field."""
    if not hasattr(cfg, _attr(section)) or not dataclasses.is_dataclass(getattr(cfg, section)):
        raise MeshtronError(f"unknown config section '{section}'{_suggest(section, SECTIONS)}")
    sec_obj = getattr(cfg, section)
    hints = {config_key(k): v for k, v in typing.get_type_hints(type(sec_obj)).items()}
    head, _, rest = key.partition(".")
    if head not in hints:
        raise MeshtronError(
            f"unknown config key '{section}.{key}'" + _suggest_dotted(section, head, hints)
        )
    nested = dataclasses.is_dataclass(hints[head])
    if nested and rest:
        try:
            return _set_field(sec_obj, head, rest, value)
        except MeshtronError as err:
            raise MeshtronError(str(err).replace(f"'{head}.", f"'{section}.{head}.")) from None
    if nested and isinstance(value, dict):
        for sub_key, sub_value in value.items():
            _set_field(cfg, section, f"{head}.{sub_key}", sub_value)
        return
    if nested or rest:
        raise MeshtronError(f"config key '{section}.{key}' does not name a field")
    setattr(sec_obj, _attr(key), _coerce(value, hints[key], f"{section}.{key}"))


def _suggest_dotted(section: str, key: str, hints: dict[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(hints), n=1)
    return f" (did you mean '{section}.{close[0]}'?)" if close else ""


def _apply_mapping(cfg: Config, data: Any, source: str) -> None:
    if data is None:
        return
    if not isinstance(data, dict):
        raise MeshtronError(f"{source}: expected a mapping of config sections at the top level")
    for section, values in data.items():
        if section not in SECTIONS:
            raise MeshtronError(
                f"{source}: unknown config section '{section}'{_suggest(str(section), SECTIONS)}"
            )
        if values is None:
            continue
        if not isinstance(values, dict):
            raise MeshtronError(f"{source}: section '{section}' must be a mapping of fields")
        for key, value in values.items():
            try:
                _set_field(cfg, section, str(key), value)
            except MeshtronError as err:
                raise MeshtronError(f"{source}: {err}") from None


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``section.field=value`` (leading dashes allowed) into its parts."""
    body = text.lstrip("-")
    if "=" not in body or "." not in body.split("=", 1)[0]:
        raise MeshtronError(f"override '{text}' must look like --section.field=value")
    name, raw = body.split("=", 1)
    section, key = name.split(".", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return section, key, value


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults, then the YAML file, then overrides; resolved and validated."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise MeshtronError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise MeshtronError(f"{p}: not valid YAML{where}") from None
        _apply_mapping(cfg, data, str(p))
    for text in overrides:
        section, key, value = parse_override(text)
        _set_field(cfg, section, key, value)
    resolve(cfg)
    validate(cfg)
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a resolved config (for example one stored in a checkpoint)."""
    cfg = Config()
    _apply_mapping(cfg, data, "config")
    resolve(cfg)
    validate(cfg)
    return cfg


# ----------------------------------------------------------------------------- resolution


def resolve(cfg: Config) -> None:
    """Fill unset model fields from the preset; everything else keeps its explicit value."""
    m = cfg.model
    if m.preset not in MODEL_PRESETS:
        raise MeshtronError(
            f"unknown model.preset '{m.preset}'{_suggest(m.preset, MODEL_PRESETS)}; "
            f"choose one of {', '.join(MODEL_PRESETS)}"
        )
    for key, value in MODEL_PRESETS[m.preset].items():
        if key == "moe":
            continue
        if getattr(m, key) is None:
            setattr(m, key, value)
    for key, value in {**MOE_DEFAULTS, **MODEL_PRESETS[m.preset].get("moe", {})}.items():
        if getattr(m.moe, key) is None:
            setattr(m.moe, key, value)
    if m.moe.expert_ffn_size is None:
        m.moe.expert_ffn_size = m.ffn_hidden_size
    if m.num_kv_heads is None:
        m.num_kv_heads = m.num_heads
    if m.rope_theta is None:
        m.rope_theta = 10000.0
    if m.norm_eps is None:
        m.norm_eps = 1e-5
    if m.tie_embeddings is None:
        m.tie_embeddings = False
    if cfg.data.path is not None:
        cfg.data.path = [p for p in cfg.data.path if p] or None


def data_parallel_size(cfg: Config, world_size: int) -> int:
    p = cfg.parallel
    return world_size // (p.tp * p.cp * p.pp)


def micro_batch_size(cfg: Config, world_size: int = 1) -> int:
    """Sequences per forward pass on one rank."""
    t = cfg.train
    return t.micro_batch or t.global_batch // max(1, data_parallel_size(cfg, world_size))


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise MeshtronError(message)


def _choice(value: str, choices: tuple[str, ...], name: str) -> None:
    _require(
        value in choices,
        f"{name}='{value}' is not one of {', '.join(choices)}{_suggest(value, choices)}",
    )


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Reject impossible settings with one sentence each (world size checked when given)."""
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    _choice(m.arch, ARCHS, "model.arch")
    _choice(cfg.precision.dtype, DTYPES, "precision.dtype")
    _choice(cfg.precision.reduce_dtype, REDUCE_DTYPES, "precision.reduce_dtype")
    _choice(cfg.precision.fp8, FP8_RECIPES, "precision.fp8")
    _choice(cfg.precision.fp8_grad, ("e5m2", "e4m3"), "precision.fp8_grad")
    _choice(cfg.precision.fp8_amax, ("max", "most_recent"), "precision.fp8_amax")
    _choice(p.schedule, SCHEDULES, "parallel.schedule")
    _choice(t.recompute, RECOMPUTE, "train.recompute")
    positive = {
        "model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
        "model.num_heads": m.num_heads, "model.num_kv_heads": m.num_kv_heads,
        "model.ffn_hidden_size": m.ffn_hidden_size, "model.vocab_multiple": m.vocab_multiple,
        "model.max_seq_len": m.max_seq_len,
        "parallel.tp": p.tp, "parallel.pp": p.pp, "parallel.cp": p.cp, "parallel.ep": p.ep,
        "parallel.vpp": p.vpp, "train.steps": t.steps, "train.global_batch": t.global_batch,
        "train.seq_len": t.seq_len, "train.eval_batches": t.eval_batches,
        "train.log_every": t.log_every, "data.vocab_size": d.vocab_size,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
        "precision.fp8_block": cfg.precision.fp8_block,
        "precision.fp8_history": cfg.precision.fp8_history,
    }
    for name, value in positive.items():
        _require(value is not None and value > 0, f"{name} must be a positive integer, got {value}")
    if m.vocab_size is not None:
        _require(m.vocab_size > 0, f"model.vocab_size must be positive, got {m.vocab_size}")
    if t.micro_batch is not None:
        _require(t.micro_batch > 0, f"train.micro_batch must be positive, got {t.micro_batch}")
    nonneg = {
        "train.warmup_steps": t.warmup_steps, "train.eval_every": t.eval_every,
        "train.grad_clip": t.grad_clip, "train.weight_decay": t.weight_decay,
        "checkpoint.every": cfg.checkpoint.every, "model.dropout": m.dropout,
    }
    for name, value in nonneg.items():
        _require(value >= 0, f"{name} must not be negative, got {value}")
    _require(t.lr > 0, f"train.lr must be positive, got {t.lr}")
    _require(0 <= t.min_lr <= t.lr, f"train.min_lr must lie in [0, train.lr], got {t.min_lr}")
    _require(m.dropout < 1, f"model.dropout must be below 1, got {m.dropout}")
    _require(0 < d.valid_fraction < 1, f"data.valid_fraction must lie in (0, 1), got "
             f"{d.valid_fraction}")
    _require(d.corpus_max_mb > 0, "data.corpus_max_mb must be positive")
    _require(cfg.run.timeout_s > 0, "run.timeout_s must be positive")
    _require(p.zero in (0, 1, 2, 3), f"parallel.zero must be 0, 1, 2 or 3, got {p.zero}")
    _require(p.cp == 1, f"parallel.cp={p.cp}: context parallelism is not implemented yet (the "
             "mesh reserves the axis); use parallel.cp=1")
    _require(p.bucket_mb > 0, f"parallel.bucket_mb must be positive, got {p.bucket_mb}")
    _require(
        m.hidden_size % m.num_heads == 0,
        f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}",
    )
    _require(
        m.num_heads % m.num_kv_heads == 0,
        f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}",
    )
    _require(
        (m.hidden_size // m.num_heads) % 2 == 0 or m.arch != "llama",
        "the head dimension (hidden_size / num_heads) must be even for rotary embeddings",
    )
    _require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds the model's positions (model.max_seq_len="
        f"{m.max_seq_len})",
    )
    if m.is_moe:
        _validate_moe(m)
    if world_size is not None:
        validate_layout(cfg, world_size)
    elif t.micro_batch is not None:
        _require(
            t.global_batch % t.micro_batch == 0,
            f"train.global_batch={t.global_batch} is not a multiple of train.micro_batch="
            f"{t.micro_batch}",
        )


def validate_layout(cfg: Config, world_size: int) -> None:
    """Checks that need the world size: the mesh shape and the batch split over dp."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    model_parallel = p.tp * p.cp * p.pp
    _require(
        world_size % model_parallel == 0,
        f"world size {world_size} is not divisible by tp*cp*pp = {p.tp}*{p.cp}*{p.pp} = "
        f"{model_parallel}",
    )
    dp = world_size // model_parallel
    _require(p.etp in (None, 1, p.tp), f"parallel.etp={p.etp} must be 1 or parallel.tp={p.tp}")
    folded_tp = p.tp if p.etp == 1 else 1
    _require((dp * p.cp * folded_tp) % p.ep == 0,
             expert_fold_message(p.ep, dp, p.cp, folded_tp))
    _require(
        m.num_heads % p.tp == 0,
        f"parallel.tp={p.tp} does not divide model.num_heads={m.num_heads}",
    )
    _require(
        m.num_kv_heads % p.tp == 0 or p.tp % m.num_kv_heads == 0,
        f"parallel.tp={p.tp} and model.num_kv_heads={m.num_kv_heads}: one must divide the other",
    )
    _require(
        m.ffn_hidden_size % p.tp == 0,
        f"parallel.tp={p.tp} does not divide model.ffn_hidden_size={m.ffn_hidden_size}",
    )
    _require(
        m.vocab_multiple % p.tp == 0,
        f"parallel.tp={p.tp} does not divide model.vocab_multiple={m.vocab_multiple} "
        "(the padded vocabulary must split evenly over tp)",
    )
    if m.is_moe:
        e = m.moe.num_experts
        _require(e % p.ep == 0, f"parallel.ep={p.ep} does not divide model.moe.num_experts={e}")
        _require(
            p.etp == 1 or m.moe.expert_ffn_size % p.tp == 0,
            f"parallel.tp={p.tp} does not divide model.moe.expert_ffn_size="
            f"{m.moe.expert_ffn_size} (experts split over tp like the MLP; parallel.etp=1 "
            "keeps them whole)",
        )
        _require(
            p.etp != 1 or p.sp or t.seq_len % p.tp == 0,
            f"parallel.etp=1 needs train.seq_len={t.seq_len} divisible by parallel.tp={p.tp} "
            "(each tp rank routes its share of the sequence)",
        )
    else:
        _require(p.ep == 1, f"parallel.ep={p.ep} needs a mixture-of-experts model "
                 "(set model.moe.num_experts)")
    if p.sp:
        _require(
            t.seq_len % p.tp == 0,
            f"parallel.sp needs train.seq_len={t.seq_len} divisible by parallel.tp={p.tp}",
        )
    if p.pp > 1 or p.vpp > 1:
        _validate_pipeline(cfg, world_size)
    if cfg.precision.fp8 == "blockwise":
        _validate_fp8_blocks(cfg)
    per_step = t.global_batch
    _require(
        per_step % dp == 0,
        f"train.global_batch={per_step} is not divisible by the data-parallel size {dp}",
    )
    mb = micro_batch_size(cfg, world_size)
    _require(
        (per_step // dp) % mb == 0,
        f"train.global_batch={per_step} is not a multiple of train.micro_batch={mb} x "
        f"data-parallel size {dp}",
    )


def _validate_moe(m: ModelConfig) -> None:
    moe = m.moe
    e = moe.num_experts
    _require(e > 0, f"model.moe.num_experts must not be negative, got {e}")
    for name in ("top_k", "expert_ffn_size", "every", "groups", "topk_groups"):
        value = getattr(moe, name)
        _require(value > 0, f"model.moe.{name} must be a positive integer, got {value}")
    for name in ("shared_experts", "dense_layers", "aux_loss", "z_loss", "bias_update",
                 "capacity_factor"):
        value = getattr(moe, name)
        _require(value >= 0, f"model.moe.{name} must not be negative, got {value}")
    _choice(moe.score, ROUTER_SCORES, "model.moe.score")
    _choice(moe.aux_loss_scope, AUX_LOSS_SCOPES, "model.moe.aux_loss_scope")
    _choice(moe.compute, EXPERT_COMPUTE, "model.moe.compute")
    _require(moe.top_k <= e, f"model.moe.top_k={moe.top_k} exceeds model.moe.num_experts={e}")
    _require(e % moe.groups == 0,
             f"model.moe.groups={moe.groups} does not divide model.moe.num_experts={e}")
    _require(moe.topk_groups <= moe.groups, f"model.moe.topk_groups={moe.topk_groups} exceeds "
             f"model.moe.groups={moe.groups}")
    _require(
        moe.top_k <= moe.topk_groups * (e // moe.groups),
        f"model.moe.top_k={moe.top_k} exceeds the experts of the model.moe.topk_groups="
        f"{moe.topk_groups} groups a token may use ({moe.topk_groups * (e // moe.groups)})",
    )
    _require(moe.dense_layers < m.num_layers, f"model.moe.dense_layers={moe.dense_layers} "
             f"leaves no MoE layer among model.num_layers={m.num_layers}")
    _require(not (moe.pad_to_capacity and moe.capacity_factor == 0),
             "model.moe.pad_to_capacity needs a model.moe.capacity_factor above 0")


def _validate_pipeline(cfg: Config, world_size: int) -> None:
    """The layer split and the schedule must exist for this micro-batch count."""
    # imported here: the pipeline modules import this one
    from meshtron.parallel.partition import check_layer_split
    from meshtron.parallel.schedules import build_schedule

    p, t = cfg.parallel, cfg.train
    check_layer_split(cfg.model, p.pp, p.vpp, p.pp_layers)
    dp = data_parallel_size(cfg, world_size)
    mb = micro_batch_size(cfg, world_size)
    if t.global_batch % dp == 0 and (t.global_batch // dp) % mb == 0:
        build_schedule(p.schedule, p.pp, p.vpp, t.global_batch // dp // mb)
    _require(
        not (p.schedule == "zb-h1" and p.zero == 3 and dp * p.cp > 1),
        "parallel.schedule=zb-h1 computes weight gradients after the block's backward has "
        "released its ZeRO-3 parameters; use parallel.zero 0, 1 or 2 with zb-h1",
    )


def _validate_fp8_blocks(cfg: Config) -> None:
    """Every tp-local dimension a blockwise-scaled linear layer reduces or produces must be a
    whole number of blocks."""
    m, tp, block = cfg.model, cfg.parallel.tp, cfg.precision.fp8_block
    head_dim = m.hidden_size // m.num_heads
    dims = {"model.hidden_size": m.hidden_size,
            "model.hidden_size / parallel.tp": m.hidden_size // tp,
            "model.ffn_hidden_size / parallel.tp": m.ffn_hidden_size // tp,
            "kv heads x head dim per tp rank": m.num_kv_heads * head_dim // min(tp, m.num_kv_heads)}
    for name, value in dims.items():
        _require(
            value % block == 0,
            f"precision.fp8=blockwise needs {name} = {value} divisible by precision.fp8_block="
            f"{block}; pick a block that divides it, pad the model, or use tensorwise scaling",
        )
