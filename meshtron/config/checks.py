"""Checks of a resolved config that need nothing but the config: each value's type, choice and
range, and the consistency of each section with itself (the head count dividing the width, a
mixture of experts' routing).

What relates sections to each other, to an architecture or to a world size is checked once,
by the run plan (:mod:`meshtron.plan`). Every failure is one sentence in a
:class:`~meshtron.errors.MeshtronError`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable

from meshtron.config.data_section import check_data_section
from meshtron.config.generation_section import check_generation
from meshtron.config.lora_section import check_lora, check_lora_run
from meshtron.config.sections import (
    ATTENTIONS,
    AUTOTUNE_MODES,
    AUX_LOSS_SCOPES,
    CP_COMMS,
    DTYPES,
    EXPERT_COMPUTE,
    FP4_RECIPES,
    FP8_RECIPES,
    MX_SCALES,
    RECOMPUTE,
    REDUCE_DTYPES,
    ROPE_SCALINGS,
    ROUTER_SCORES,
    SCHEDULES,
    Config,
    ModelConfig,
    PrecisionConfig,
)
from meshtron.config.vision_section import check_vision
from meshtron.errors import MeshtronError


def suggest(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest candidate, or nothing."""
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def require(cond: bool, message: str) -> None:
    if not cond:
        raise MeshtronError(message)


def choice(value: str, choices: Iterable[str], name: str) -> None:
    choices = tuple(choices)
    if value not in choices:  # the suggestion's string matching only for a refusal: the cost
        # model's search checks a model's architecture on every candidate it prices
        raise MeshtronError(f"{name}='{value}' is not one of {', '.join(choices)}"
                            f"{suggest(value, choices)}")


SANITY_LIMITS = {
    "model.num_layers": 100_000, "model.hidden_size": 2**20, "model.ffn_hidden_size": 2**24,
    "model.num_heads": 2**16, "model.max_seq_len": 2**27, "model.vocab_size": 2**32,
    "train.global_batch": 2**24, "train.seq_len": 2**27, "train.steps": 10**12,
    "data.vocab_size": 2**24,
}
"""Sizes far beyond the largest models trained (10T parameters fit inside them): a value
past one is a typo, refused before it allocates terabytes or loops for hours."""


def validate(cfg: Config) -> None:
    """Reject impossible values with one sentence each."""
    m, p, t, d, pc = cfg.model, cfg.parallel, cfg.train, cfg.data, cfg.precision
    choice(pc.dtype, DTYPES, "precision.dtype")
    choice(pc.reduce_dtype, REDUCE_DTYPES, "precision.reduce_dtype")
    choice(pc.fp8, FP8_RECIPES, "precision.fp8")
    choice(pc.fp8_grad, ("e5m2", "e4m3"), "precision.fp8_grad")
    choice(pc.fp8_amax, ("max", "most_recent"), "precision.fp8_amax")
    _check_low_precision(pc, m.num_layers)
    choice(p.schedule, SCHEDULES, "parallel.schedule")
    choice(p.cp_comm, CP_COMMS, "parallel.cp_comm")
    choice(t.recompute, RECOMPUTE, "train.recompute")
    choice(cfg.checkpoint.on_corrupt, ("error", "previous"), "checkpoint.on_corrupt")
    choice(cfg.run.wandb, ("off", "offline", "online"), "run.wandb")
    check_generation(cfg.generation)
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
        "precision.fp8_block": pc.fp8_block, "precision.fp8_history": pc.fp8_history,
        "parallel.tp_comm_chunks": p.tp_comm_chunks,
    }
    for name, value in positive.items():
        require(value is not None and value > 0,
                f"{name} must be a positive integer, got {value}")
    for name, limit in SANITY_LIMITS.items():
        section, field = name.split(".")
        value = getattr(getattr(cfg, section), field)
        require(value is None or value <= limit, f"{name}={value} is beyond any model this "
                f"runs (at most {limit:,}): a typo?")
    if m.vocab_size is not None:
        require(m.vocab_size > 0, f"model.vocab_size must be positive, got {m.vocab_size}")
    require(p.receives_ahead is None or p.receives_ahead >= 0,
            f"parallel.receives_ahead must be 0 or more, got {p.receives_ahead}")
    if t.micro_batch is not None:
        require(t.micro_batch > 0, f"train.micro_batch must be positive, got {t.micro_batch}")
        require(t.global_batch % t.micro_batch == 0,
                f"train.global_batch={t.global_batch} is not a multiple of train.micro_batch="
                f"{t.micro_batch}")
    finite = {"train.lr": t.lr, "train.min_lr": t.min_lr, "train.eps": t.eps,
              "train.weight_decay": t.weight_decay, "train.grad_clip": t.grad_clip,
              "model.init_std": m.init_std, "model.dropout": m.dropout,
              "checkpoint.every_seconds": cfg.checkpoint.every_seconds,
              "model.mtp_loss_weight": m.mtp_loss_weight}
    for name, value in finite.items():
        require(math.isfinite(value), f"{name} must be a finite number, got {value}")
    nonneg = {
        "train.warmup_steps": t.warmup_steps, "train.eval_every": t.eval_every,
        "train.grad_clip": t.grad_clip, "train.weight_decay": t.weight_decay,
        "checkpoint.every": cfg.checkpoint.every, "model.dropout": m.dropout,
        "checkpoint.every_seconds": cfg.checkpoint.every_seconds,
        "run.straggler_every": cfg.run.straggler_every, "model.mtp_depth": m.mtp_depth,
        "train.eval_generate": t.eval_generate,
        "model.mtp_loss_weight": m.mtp_loss_weight,
    }
    for name, value in nonneg.items():
        require(value >= 0, f"{name} must not be negative, got {value}")
    require(t.lr > 0, f"train.lr must be positive, got {t.lr}")
    require(t.autotune in AUTOTUNE_MODES, f"train.autotune must be one of "
            f"{', '.join(AUTOTUNE_MODES)}, got {t.autotune!r}")
    require(isinstance(t.autotune_every, int) and t.autotune_every >= 1,
            f"train.autotune_every must be a positive whole number, got {t.autotune_every}")
    require(math.isfinite(t.autotune_drift) and t.autotune_drift > 0,
            f"train.autotune_drift must be a positive number, got {t.autotune_drift}")
    require(t.autotune != "layout" or (t.autotune_profile and cfg.checkpoint.resume),
            "train.autotune=layout ranks layouts with the cost model and resumes the new one "
            "from a checkpoint: set train.autotune_profile (a GPU name or a profile .json of "
            "meshtron tune --calibrate) and keep checkpoint.resume=true")
    require(t.max_skipped >= 1, f"train.max_skipped must be at least 1, got {t.max_skipped}")
    require(math.isfinite(cfg.run.straggler_factor) and cfg.run.straggler_factor > 1,
            f"run.straggler_factor must be a number above 1, got {cfg.run.straggler_factor}")
    for name, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        require(0 <= beta < 1, f"{name} must lie in [0, 1), got {beta}")
    require(t.eps > 0, f"train.eps must be positive, got {t.eps}")
    require(m.init_std >= 0, f"model.init_std must not be negative, got {m.init_std}")
    require(isinstance(m.mup_base_width, int) and m.mup_base_width > 0,
            f"model.mup_base_width must be a positive integer, got {m.mup_base_width}")
    require(not (m.mup and m.attention == "mla"), "model.mup does not combine with "
            "model.attention=mla yet (latent attention keeps its own softmax scale)")
    require(0 <= t.min_lr <= t.lr, f"train.min_lr must lie in [0, train.lr], got {t.min_lr}")
    require(m.dropout < 1, f"model.dropout must be below 1, got {m.dropout}")
    unsampled = [f"{name}={value}" for name, value, plain in (
        ("parallel.cp", p.cp, 1), ("parallel.ep", p.ep, 1), ("parallel.vpp", p.vpp, 1),
        ("parallel.zero", p.zero, 0), ("precision.fp8", pc.fp8, "none"),
        ("precision.fp4", pc.fp4, "none")) if value != plain]
    require(not (t.eval_generate and unsampled), f"train.eval_generate samples on one model "
            f"replica and does not combine with {', '.join(unsampled)} yet; set it to 0")
    require(m.mtp_depth < t.seq_len, f"model.mtp_depth={m.mtp_depth} predicts tokens up to "
            f"{m.mtp_depth + 1} ahead: train.seq_len={t.seq_len} leaves none of them a target "
            "inside the window; lower model.mtp_depth")
    require(0 < d.valid_fraction < 1,
            f"data.valid_fraction must lie in (0, 1), got {d.valid_fraction}")
    require(d.corpus_max_mb > 0, "data.corpus_max_mb must be positive")
    check_data_section(d)
    require(cfg.run.timeout_s > 0, "run.timeout_s must be positive")
    resume_from = cfg.checkpoint.resume_from
    require(resume_from is None or (resume_from != "" and cfg.checkpoint.resume),
            "checkpoint.resume_from needs checkpoint.resume=true and a step number or a "
            "checkpoint directory")
    require(p.zero in (0, 1, 2, 3), f"parallel.zero must be 0, 1, 2 or 3, got {p.zero}")
    require(math.isfinite(p.bucket_mb) and p.bucket_mb > 0,
            f"parallel.bucket_mb must be a positive number, got {p.bucket_mb}")
    require(m.rope_theta is None or (math.isfinite(m.rope_theta) and m.rope_theta > 0),
            f"model.rope_theta must be a positive number, got {m.rope_theta}")
    require(m.norm_eps is None or (math.isfinite(m.norm_eps) and m.norm_eps > 0),
            f"model.norm_eps must be a positive number, got {m.norm_eps}")
    require(t.peak_flops is None or (math.isfinite(t.peak_flops) and t.peak_flops > 0),
            f"train.peak_flops must be a positive number of FLOP/s (or unset), got "
            f"{t.peak_flops}")
    require(not (pc.dtype == "fp64" and pc.fp8 != "none"),
            "precision.dtype=fp64 is for verification runs and does not combine with "
            f"precision.fp8={pc.fp8}")
    require(d.document_mask or not d.reset_positions,
            "data.reset_positions restarts positions at document boundaries: it needs "
            "data.document_mask=true")
    require(not (pc.dtype == "fp64" and pc.reduce_dtype != "fp32"),
            "precision.dtype=fp64 reduces gradients in fp64; leave precision.reduce_dtype at "
            "fp32")
    require(-(2**63) <= t.seed < 2**64, f"train.seed must fit in 64 bits (-2**63 to 2**64-1), "
            f"got {t.seed}")
    check_paths(cfg)
    check_model_shape(m)
    check_lora_run(cfg)


NAME_MAX, PATH_MAX = 255, 4095
"""Bytes of one name and of a whole path that Linux and macOS file systems accept."""


def check_paths(cfg: Config) -> None:
    """The folders a run writes to are names a file system can hold: not empty (an empty
    run.dir would write into the current folder), no NUL byte, no name over 255 bytes (the OS
    refuses those with a traceback at the first stat, not at the config)."""
    named = {"run.dir": cfg.run.dir, "checkpoint.dir": cfg.checkpoint.dir,
             "data.cache_dir": cfg.data.cache_dir}
    for name, value in named.items():
        if value is None:
            continue
        require(value.strip() != "", f"{name} is empty; name a folder (. for the current one)")
        require("\0" not in value, f"{name} holds a NUL byte, which no file name may")
        encoded = value.encode("utf-8", "surrogateescape")
        require(len(encoded) <= PATH_MAX, f"{name} is {len(encoded):,} bytes long; a path "
                f"may have at most {PATH_MAX:,}")
        longest = max(encoded.split(b"/"), key=len)
        require(len(longest) <= NAME_MAX, f"{name} has a name of {len(longest):,} bytes "
                f"('{longest[:20].decode('utf-8', 'replace')}...'); a file system allows at "
                f"most {NAME_MAX} per name")


def inert_settings(cfg: Config) -> list[str]:
    """Settings that are valid but do nothing in this config, one sentence each, for the
    command to say as a note: a config written for one layout still runs under another (the
    tuner and train.autotune move between layouts), so they are not refused."""
    notes = []
    if cfg.parallel.sp and cfg.parallel.tp == 1:
        notes.append("parallel.sp=true has no effect at parallel.tp=1 (sequence parallelism "
                     "splits the residual stream over tp ranks)")
    return notes


def check_model_shape(m: ModelConfig) -> None:
    """The model section on its own: heads, kv heads, the attention and rotary settings and
    the mixture of experts."""
    _check_latent(m)  # latent attention has its own widths (and refuses a head_dim)
    if m.head_dim is None:
        require(m.latent_attention or m.hidden_size % m.num_heads == 0,
                f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads="
                f"{m.num_heads} (or set model.head_dim)")
    else:
        require(m.head_dim > 0, f"model.head_dim must be a positive integer, got {m.head_dim}")
        require(m.head_dim % 2 == 0 or m.arch == "gpt2",
                f"model.head_dim={m.head_dim} must be even for rotary embeddings")
    require(
        m.num_heads % m.num_kv_heads == 0,
        f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}",
    )
    if m.sliding_window is not None:
        require(m.sliding_window > 0,
                f"model.sliding_window must be a positive integer, got {m.sliding_window}")
    _check_gemma_settings(m)
    if m.arch == "gpt2":
        extras = [name for name, on in (
            ("qkv_bias", m.qkv_bias), ("proj_bias", m.proj_bias), ("mlp_bias", m.mlp_bias),
            ("qk_norm", m.qk_norm), ("head_dim", m.head_dim is not None),
            ("rope.scaling", m.rope.scaling != "none")) if on]
        if extras:
            raise MeshtronError(f"model.{extras[0]} is a llama-arch setting (gpt2 has biases "
                                "everywhere, no q/k norms and learned positions)")
    _check_rope(m)
    check_vision(m.vision)
    check_lora(m.lora)
    if m.is_moe:
        require(not m.mlp_bias, "model.mlp_bias is not supported with routed experts (experts "
                "have no biases)")
        _check_moe(m)


def _check_gemma_settings(m: ModelConfig) -> None:
    """Interleaved windows, local rotary base, score scalar and logit cap: positive, and a
    window pattern only with a window."""
    pattern = m.sliding_window_pattern
    if pattern is not None:
        require(pattern > 0, f"model.sliding_window_pattern must be a positive integer, got "
                f"{pattern}")
        require(m.sliding_window is not None, f"model.sliding_window_pattern={pattern} needs "
                "model.sliding_window (the width of the local layers' window)")
    for name in ("rope_local_theta", "query_pre_attn_scalar", "logit_softcap"):
        value = getattr(m, name)
        require(value is None or (math.isfinite(value) and value > 0),
                f"model.{name} must be a positive number, got {value}")


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")


def _check_latent(m: ModelConfig) -> None:
    """Latent attention's widths are all given (q_lora_rank may be 0) and fit; grouped-query
    attention's settings and mla's do not mix."""
    choice(m.attention or "mha", ATTENTIONS, "model.attention")
    mscale = m.rope.mscale_all_dim
    require(math.isfinite(mscale) and mscale >= 0,
            f"model.rope.mscale_all_dim must not be negative, got {mscale}")
    if not m.latent_attention:
        given = [name for name in MLA_FIELDS if getattr(m, name) is not None]
        given += ["rope.mscale_all_dim"] if mscale else []
        require(not given, f"model.{given[0] if given else ''} is a latent-attention setting: it "
                "needs model.attention=mla")
        return
    for name in MLA_FIELDS:
        value = getattr(m, name)
        least = 0 if name == "q_lora_rank" else 1
        require(value is not None, f"model.attention=mla needs model.{name}"
                + (" (0: queries are not compressed)" if name == "q_lora_rank" else ""))
        what = "must not be negative" if least == 0 else "must be a positive integer"
        require(value >= least, f"model.{name} {what} with model.attention=mla, got {value}")
    require(m.qk_rope_head_dim % 2 == 0,
            f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even for rotary embeddings")
    require(m.arch == "llama", f"model.attention=mla needs model.arch=llama (RMSNorm and rotary "
            f"positions), got model.arch={m.arch}")
    require(m.num_kv_heads == m.num_heads, f"model.num_kv_heads={m.num_kv_heads} with "
            f"model.attention=mla: every head has its own keys and values from the latent; set "
            f"it to model.num_heads={m.num_heads} or leave it unset")
    extras = [name for name, on in (
        ("head_dim", m.head_dim is not None), ("qkv_bias", m.qkv_bias),
        ("proj_bias", m.proj_bias), ("qk_norm", m.qk_norm),
        ("sliding_window", m.sliding_window is not None)) if on]
    require(not extras, f"model.{extras[0] if extras else ''} does not combine with "
            "model.attention=mla (latent attention sets its own widths and has no biases, q/k "
            "norms or window)")


def _check_rope(m: ModelConfig) -> None:
    rope = m.rope
    choice(rope.scaling, ROPE_SCALINGS, "model.rope.scaling")
    values = {"factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
              "high_freq_factor": rope.high_freq_factor, "beta_fast": rope.beta_fast,
              "beta_slow": rope.beta_slow}
    if rope.attention_factor is not None:
        values["attention_factor"] = rope.attention_factor
    for name, value in values.items():
        require(math.isfinite(value) and value > 0,
                f"model.rope.{name} must be a positive number, got {value}")
    if rope.original_max_len is not None:
        require(rope.original_max_len > 0, "model.rope.original_max_len must be a positive "
                f"integer, got {rope.original_max_len}")
    if rope.scaling == "llama3":
        require(rope.high_freq_factor > rope.low_freq_factor, "model.rope.high_freq_factor="
                f"{rope.high_freq_factor} must exceed model.rope.low_freq_factor="
                f"{rope.low_freq_factor}")


def _check_moe(m: ModelConfig) -> None:
    moe = m.moe
    e = moe.num_experts
    require(e > 0, f"model.moe.num_experts must not be negative, got {e}")
    for name in ("top_k", "expert_ffn_size", "every", "groups", "topk_groups"):
        value = getattr(moe, name)
        require(value > 0, f"model.moe.{name} must be a positive integer, got {value}")
    for name in ("shared_experts", "dense_layers", "aux_loss", "z_loss", "bias_update",
                 "capacity_factor"):
        value = getattr(moe, name)
        require(value >= 0, f"model.moe.{name} must not be negative, got {value}")
        require(math.isfinite(value), f"model.moe.{name} must be a finite number, got {value}")
    require(math.isfinite(moe.route_scale) and moe.route_scale > 0,
            f"model.moe.route_scale must be a positive number, got {moe.route_scale}")
    choice(moe.score, ROUTER_SCORES, "model.moe.score")
    choice(moe.aux_loss_scope, AUX_LOSS_SCOPES, "model.moe.aux_loss_scope")
    choice(moe.compute, EXPERT_COMPUTE, "model.moe.compute")
    require(moe.top_k <= e, f"model.moe.top_k={moe.top_k} exceeds model.moe.num_experts={e}")
    require(e % moe.groups == 0,
            f"model.moe.groups={moe.groups} does not divide model.moe.num_experts={e}")
    require(moe.topk_groups <= moe.groups, f"model.moe.topk_groups={moe.topk_groups} exceeds "
            f"model.moe.groups={moe.groups}")
    require(
        moe.top_k <= moe.topk_groups * (e // moe.groups),
        f"model.moe.top_k={moe.top_k} exceeds the experts of the model.moe.topk_groups="
        f"{moe.topk_groups} groups a token may use ({moe.topk_groups * (e // moe.groups)})",
    )
    require(moe.dense_layers < m.num_layers, f"model.moe.dense_layers={moe.dense_layers} "
            f"leaves no MoE layer among model.num_layers={m.num_layers}")
    require(not (moe.pad_to_capacity and moe.capacity_factor == 0),
            "model.moe.pad_to_capacity needs a model.moe.capacity_factor above 0")


def _check_low_precision(pc: PrecisionConfig, num_layers: int) -> None:
    """The FP8/FP4 recipes and the per-layer policy: known names, block indices inside the
    model, no block both in FP4 and kept in high precision, and a dtype the recipe trains in."""
    choice(pc.fp4, FP4_RECIPES, "precision.fp4")
    choice(pc.mx_scale, MX_SCALES, "precision.mx_scale")
    for name, layers in (("precision.fp4_layers", pc.fp4_layers),
                         ("precision.keep_layers", pc.keep_layers)):
        for i in layers or ():
            require(isinstance(i, int) and -num_layers <= i < num_layers, f"{name} names "
                    f"block {i}, but the model has blocks 0..{num_layers - 1} (or -1..-"
                    f"{num_layers} from the end)")
    require(pc.fp4_layers is None or pc.fp4 != "none", "precision.fp4_layers chooses the "
            "blocks in FP4: set precision.fp4=nvfp4 too")
    kept = {i % num_layers for i in pc.keep_layers or ()}
    both = sorted(kept & {i % num_layers for i in pc.fp4_layers or ()})
    require(not both, f"precision.fp4_layers puts block {both[0] if both else ''} in FP4, but "
            "precision.keep_layers keeps it in high precision; drop it from one of the two")
    new = [f"precision.{name}={value}" for name, value in (("fp8", pc.fp8), ("fp4", pc.fp4))
           if value in ("mxfp8", "nvfp4")]
    # fp64 with mxfp8 is refused above; nvfp4 in fp64 is a verification run (products in fp64)
    require(not new or pc.dtype in ("bf16", "fp32", "fp64"), f"{' and '.join(new)} train with "
            f"bf16 (or fp32) parameters, not precision.dtype={pc.dtype}: use "
            "precision.dtype=bf16")
    require(not pc.fp8_param_gather or pc.fp8 != "none" or pc.fp4 != "none",
            "precision.fp8_param_gather gathers the weights of the FP8/FP4 blocks' linear "
            "layers: set precision.fp8 or precision.fp4 too")
