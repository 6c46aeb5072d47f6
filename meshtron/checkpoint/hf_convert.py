"""Conversion between meshtron checkpoints and Hugging Face model folders.

``convert(src, dst, fmt)`` detects what ``src`` is (a Hugging Face folder with ``config.json``
and safetensors weights, or a meshtron run directory / checkpoint root / checkpoint) and writes
the other format to ``dst``:

* meshtron -> hf: ``config.json`` (``LlamaForCausalLM``, ``MixtralForCausalLM`` or
  ``GPT2LMHeadModel``), ``model.safetensors`` and, when the checkpoint has one,
  ``tokenizer.json`` with a minimal ``tokenizer_config.json``;
* hf -> meshtron: a weights-only checkpoint (``write_model_checkpoint``) plus ``train.yaml``,
  the settings that resume training from it.

Llama and Mistral (without a binding sliding window) map to meshtron's ``llama`` arch, Mixtral to
``llama`` with every layer a mixture of experts (``model.moe.*``), GPT-2 to ``gpt2``. A meshtron
MoE model exports as Mixtral only when Mixtral can compute it exactly (softmax top-k>1 routing,
renormalised, no shared experts, groups, dense layers, capacity or selection bias).

Weights are read with safetensors only: pickled files (``pytorch_model.bin``, ``.pt``)
are refused, never opened. The vocabulary is kept exactly: ``vocab_multiple`` is chosen so the
padded size equals the HF vocab, so the logits of both models have the same shape and values.
Nothing here imports ``transformers``; its config files are read and written as JSON.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from meshtron.checkpoint.hf_mapping import from_hf, hf_config_kwargs, to_hf
from meshtron.checkpoint.loading import resolve_checkpoint
from meshtron.checkpoint.model_io import read_model_tensors, write_model_checkpoint
from meshtron.config import Config, ModelConfig, MoEConfig, config_from_dict
from meshtron.data import Tokenizer
from meshtron.errors import MeshtronError
from meshtron.models.transformer import Transformer, padded_vocab_size

Tensors = dict[str, torch.Tensor]
FORMATS = ("meshtron", "hf")
SUPPORTED = "Llama, Mistral, Mixtral and GPT-2"
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel"}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
IGNORED_HF_TENSORS = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")
"""Buffers some HF checkpoints carry that are recomputed, not learned."""
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                  hidden_act="silu",
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  sliding_window=None, rope_theta=10000.0),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    hidden_act="silu", max_position_embeddings=4096 * 32, rms_norm_eps=1e-6,
                    tie_word_embeddings=False, sliding_window=4096, rope_theta=10000.0),
    "mixtral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    hidden_act="silu", max_position_embeddings=4096 * 32, rms_norm_eps=1e-5,
                    tie_word_embeddings=False, sliding_window=None, rope_theta=1e6,
                    num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.001,
                    router_jitter_noise=0.0),
    "gpt2": dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                 n_positions=1024, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                 tie_word_embeddings=True, scale_attn_weights=True,
                 scale_attn_by_inverse_layer_idx=False, add_cross_attention=False),
}
"""The ``transformers`` class defaults of the fields read, for config.json files that omit them."""
INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "n_embd",
              "n_layer", "n_head", "n_inner", "n_positions", "num_local_experts",
              "num_experts_per_tok")
MOE_TRAINING_FIELDS = ("aux_loss_scope", "z_loss", "bias_update", "compute")
"""``model.moe`` settings that only shape training, which HF Mixtral has no field for: an export
keeps them under ``meshtron`` in config.json so that importing it back restores them."""
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Conversion:
    """What :func:`convert` wrote."""

    output: Path
    """The HF folder, or the meshtron checkpoint directory (``dst/step_*``)."""
    notes: tuple[str, ...] = ()
    """Things the user should know (a tokenizer left out, how to resume training)."""


def convert(src: Path, dst: Path, fmt: str = "meshtron") -> Conversion:
    """Convert the model at ``src`` (either format, detected) to ``fmt`` under ``dst``."""
    if fmt not in FORMATS:
        raise MeshtronError(f"--format must be one of {', '.join(FORMATS)}, got '{fmt}'")
    kind = detect_source(src)
    if kind == fmt:
        name = "a Hugging Face model folder" if kind == "hf" else "a meshtron checkpoint"
        raise MeshtronError(f"{src} is already {name}; converting to the same format is refused "
                            f"(copy it instead, or choose the other --format)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise MeshtronError(f"destination {dst} exists and is not empty")
    return import_hf(src, dst) if kind == "hf" else export_hf(resolve_checkpoint(src), dst)


def detect_source(src: Path) -> str:
    """``"hf"`` for a Hugging Face folder, ``"meshtron"`` for a run, checkpoint root or one
    checkpoint."""
    if not src.exists():
        raise MeshtronError(f"source not found: {src}")
    if src.is_file():
        if src.suffix in PICKLE_SUFFIXES:
            _refuse_pickle(src, [src.name])
        raise MeshtronError(f"{src} is a file; give the folder of a Hugging Face model or a "
                            "meshtron run or checkpoint")
    if (src / "config.json").is_file():
        return "hf"
    meshtron_marks = ("meta.json", "latest", "config.yaml")
    if any((src / m).exists() for m in meshtron_marks) or any(src.glob("step_*")):
        return "meshtron"
    _refuse_pickle(src, _pickled_files(src))
    raise MeshtronError(f"{src} is neither a Hugging Face model folder (config.json + "
                        "safetensors) nor a meshtron run or checkpoint")


def _pickled_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)


def _refuse_pickle(where: Path, names: list[str]) -> None:
    if names:
        raise MeshtronError(
            f"{where} holds pickled weights ({', '.join(names)}) and only safetensors are read; "
            "re-save the model with save_pretrained(safe_serialization=True)")


# ----------------------------------------------------------------------------- configs


def hf_model_config(hf: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """A meshtron ``ModelConfig`` from an HF ``config.json`` dict, refusing what meshtron's
    decoder cannot compute exactly (rope scaling, biases, sliding windows, other activations,
    a Mixtral routing each token to one expert)."""
    model_type = _model_type(hf, where)
    defaults = HF_DEFAULTS[model_type]

    def get(key: str) -> Any:
        value = hf.get(key, defaults[key])
        if key in INT_FIELDS and value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise MeshtronError(f"{where}: '{key}' must be a positive integer, got {value!r}")
        return value

    def require(ok: bool, reason: str) -> None:
        if not ok:
            raise MeshtronError(f"{where}: {reason}")

    if model_type == "gpt2":
        require(get("activation_function") in ("gelu_new", "gelu_pytorch_tanh"),
                f"activation_function='{get('activation_function')}' is not supported "
                "(meshtron's GPT-2 uses the tanh GELU: gelu_new)")
        require(bool(get("scale_attn_weights")) and not get("scale_attn_by_inverse_layer_idx"),
                "GPT-2 attention must be scaled by 1/sqrt(head_dim) only")
        require(not get("add_cross_attention"), "cross-attention is not supported")
        hidden = get("n_embd")
        cfg = ModelConfig(
            arch="gpt2", num_layers=get("n_layer"), hidden_size=hidden, num_heads=get("n_head"),
            num_kv_heads=get("n_head"), ffn_hidden_size=get("n_inner") or 4 * hidden,
            max_seq_len=get("n_positions"), norm_eps=get("layer_norm_epsilon"),
            tie_embeddings=bool(get("tie_word_embeddings")),
        )
    else:
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        require(get("hidden_act") in ("silu", "swish"),
                f"hidden_act='{get('hidden_act')}' is not supported (meshtron uses SwiGLU: silu)")
        require(not hf.get("attention_bias") and not hf.get("mlp_bias"),
                "attention or MLP biases are not supported for Llama-style models")
        head_dim = hf.get("head_dim") or hidden // heads
        require(head_dim == hidden // heads,
                f"head_dim={head_dim} differs from hidden_size / num_attention_heads "
                f"({hidden} / {heads}), which meshtron requires")
        max_pos = get("max_position_embeddings")
        window = get("sliding_window")
        require(window is None or window >= max_pos,
                f"sliding_window={window} is shorter than max_position_embeddings={max_pos}, "
                "and meshtron has no sliding-window attention")
        cfg = ModelConfig(
            arch="llama", num_layers=get("num_hidden_layers"), hidden_size=hidden,
            num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
            ffn_hidden_size=get("intermediate_size"),
            max_seq_len=max_pos, rope_theta=_rope_theta(hf, where, get("rope_theta")),
            norm_eps=get("rms_norm_eps"), tie_embeddings=bool(get("tie_word_embeddings")),
        )
        if model_type == "mixtral":
            top_k, experts = get("num_experts_per_tok"), get("num_local_experts")
            require(top_k > 1, "num_experts_per_tok=1 is not supported (Mixtral renormalises "
                    "a lone expert's weight to 1, meshtron keeps its probability)")
            require(top_k <= experts, f"num_experts_per_tok={top_k} exceeds "
                    f"num_local_experts={experts}")
            cfg.moe = MoEConfig(
                num_experts=experts, top_k=top_k,
                expert_ffn_size=get("intermediate_size"), shared_experts=0, dense_layers=0,
                every=1, score="softmax", normalize_topk=True, route_scale=1.0, groups=1,
                topk_groups=1, aux_loss=get("router_aux_loss_coef"), capacity_factor=0.0,
                pad_to_capacity=False,
            )
            _restore_training_fields(hf, cfg)
    cfg.vocab_size, cfg.vocab_multiple = _vocab(hf, get("vocab_size"))
    return cfg


def _restore_training_fields(hf: dict[str, Any], cfg: ModelConfig) -> None:
    """Settings a meshtron export kept under ``meshtron`` (see :data:`MOE_TRAINING_FIELDS`;
    ``ffn_hidden_size``, unused when every layer has experts). Their values are validated with
    the rest of the config."""
    saved = _saved(hf)
    if "ffn_hidden_size" in saved:
        cfg.ffn_hidden_size = saved["ffn_hidden_size"]
    moe = saved.get("moe")
    for key in MOE_TRAINING_FIELDS:
        if isinstance(moe, dict) and key in moe:
            setattr(cfg.moe, key, moe[key])


def _saved(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``meshtron`` block a meshtron export writes into config.json (empty if none)."""
    saved = hf.get("meshtron")
    return saved if isinstance(saved, dict) else {}


def _model_type(hf: dict[str, Any], where: str) -> str:
    model_type = hf.get("model_type")
    if model_type is None:  # older files name only the class
        by_class = {v: k for k, v in HF_CLASSES.items()}
        model_type = next((by_class[a] for a in hf.get("architectures") or [] if a in by_class),
                          None)
    if model_type not in HF_DEFAULTS:
        found = model_type or "/".join(hf.get("architectures") or []) or "unknown"
        raise MeshtronError(f"{where}: unsupported architecture '{found}'; meshtron converts "
                            f"{SUPPORTED}")
    return model_type


def _rope_theta(hf: dict[str, Any], where: str, default: float) -> float:
    """The rotary base, from ``rope_parameters`` (transformers 5) or the older flat fields
    (``default``: the config class's)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise MeshtronError(f"{where}: rope scaling '{rope_type}' is not supported (meshtron has "
                            "plain rotary embeddings only)")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise MeshtronError(f"{where}: partial_rotary_factor={partial} is not supported")
    return float(params.get("rope_theta", hf.get("rope_theta", default)))


def _vocab(hf: dict[str, Any], vocab: int) -> tuple[int, int]:
    """(vocab_size, vocab_multiple) whose padded size is exactly ``vocab``: the values meshtron
    exported when they fit, else the largest power of two up to 128 that divides ``vocab``
    (tensor parallelism needs tp to divide vocab_multiple)."""
    saved = _saved(hf)
    size, multiple = saved.get("vocab_size"), saved.get("vocab_multiple")
    if (isinstance(size, int) and isinstance(multiple, int) and 0 < size <= vocab
            and multiple > 0 and math.ceil(size / multiple) * multiple == vocab):
        return size, multiple
    return vocab, math.gcd(vocab, 128)


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype, eos_id: int | None) -> dict[str, Any]:
    """The ``config.json`` of the HF twin of ``cfg`` (``LlamaConfig``, ``MixtralConfig`` or
    ``GPT2Config`` fields)."""
    if cfg.is_moe:
        _check_mixtral(cfg)
    if cfg.arch == "gpt2" and cfg.num_kv_heads != cfg.num_heads:
        raise MeshtronError(f"a GPT-2 model with num_kv_heads={cfg.num_kv_heads} < num_heads="
                            f"{cfg.num_heads} has no Hugging Face equivalent")
    arch = "gpt2" if cfg.arch == "gpt2" else "mixtral" if cfg.is_moe else "llama"
    extra: dict[str, Any] = (
        dict(scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False) if arch == "gpt2"
        else dict(hidden_act="silu", head_dim=cfg.hidden_size // cfg.num_heads)
    )
    saved: dict[str, Any] = {"vocab_size": cfg.vocab_size, "vocab_multiple": cfg.vocab_multiple}
    if cfg.is_moe:
        saved["ffn_hidden_size"] = cfg.ffn_hidden_size
        saved["moe"] = {key: getattr(cfg.moe, key) for key in MOE_TRAINING_FIELDS}
    return {
        "architectures": [HF_CLASSES[arch]], "model_type": arch, **hf_config_kwargs(cfg), **extra,
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": None,
        "torch_dtype": DTYPE_NAMES.get(dtype, "float32"), "meshtron": saved,
    }


def _check_mixtral(cfg: ModelConfig) -> None:
    """Refuse, in one line naming every offending setting, an MoE model that HF Mixtral cannot
    compute (Mixtral: llama blocks, every MLP routed, softmax top-k>1 renormalised, dropless)."""
    moe = cfg.moe
    checks = (
        (cfg.arch == "llama", f"model.arch={cfg.arch}"),
        (moe.shared_experts == 0, f"model.moe.shared_experts={moe.shared_experts}"),
        (moe.score == "softmax", f"model.moe.score={moe.score}"),
        (moe.groups == 1, f"model.moe.groups={moe.groups}"),
        (moe.dense_layers == 0, f"model.moe.dense_layers={moe.dense_layers}"),
        (moe.every == 1, f"model.moe.every={moe.every}"),
        (moe.normalize_topk, "model.moe.normalize_topk=false"),
        (moe.top_k > 1, "model.moe.top_k=1 (Mixtral renormalises a lone expert's weight to 1)"),
        (moe.route_scale == 1.0, f"model.moe.route_scale={moe.route_scale}"),
        (moe.capacity_factor == 0, f"model.moe.capacity_factor={moe.capacity_factor}"),
    )
    refused = [reason for ok, reason in checks if not ok]
    if refused:
        raise MeshtronError("this mixture-of-experts model has no Hugging Face Mixtral "
                            f"equivalent: {', '.join(refused)}")


def _expected_state(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every parameter of a meshtron model of ``cfg`` and its shape (built on the meta device:
    no memory, no compute)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: t.shape for name, t in model.state_dict().items()}


def _expected_hf(cfg: ModelConfig) -> dict[str, torch.Size]:
    meta = {name: torch.empty(shape, device="meta") for name, shape in _expected_state(cfg).items()}
    hf = to_hf(meta, cfg)
    if cfg.tie_embeddings:
        del hf["lm_head.weight"]
    return {name: t.shape for name, t in hf.items()}


# ----------------------------------------------------------------------------- hf -> meshtron


def import_hf(src: Path, dst: Path) -> Conversion:
    """Write the HF model in ``src`` as a meshtron checkpoint under ``dst``."""
    config_path = src / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MeshtronError(f"{config_path} cannot be read as JSON ({err})") from None
    if not isinstance(hf, dict):
        raise MeshtronError(f"{config_path} does not hold a JSON object")
    model_cfg = hf_model_config(hf, str(config_path))
    cfg = Config(model=model_cfg)
    cfg.train.seq_len = min(cfg.train.seq_len, model_cfg.max_seq_len)
    try:
        cfg = config_from_dict(cfg.to_dict())
    except MeshtronError as err:
        raise MeshtronError(f"{config_path}: {err}") from None
    tensors = from_hf(read_hf_tensors(src, cfg.model), cfg.model)
    tokenizer, notes = _hf_tokenizer(src, padded_vocab_size(cfg.model))
    jitter = hf.get("router_jitter_noise")
    if model_cfg.is_moe and jitter:
        notes.append(f"router_jitter_noise={jitter} was dropped: meshtron's router has no "
                     "input jitter (a training-time noise; the logits are unaffected)")
    checkpoint = write_model_checkpoint(dst, cfg, tensors, tokenizer=tokenizer)
    settings: dict[str, Any] = {"model": cfg.to_dict()["model"],
                                "train": {"seq_len": cfg.train.seq_len},
                                "checkpoint": {"dir": str(dst.resolve())}}
    if tokenizer is not None:  # outside step_* (which training may prune): a stable path
        shutil.copyfile(tokenizer, dst / "tokenizer.json")
        settings["data"] = {"tokenizer": str((dst / "tokenizer.json").resolve())}
    (dst / "train.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    notes.append(f"continue training with: meshtron train --config {dst / 'train.yaml'}")
    return Conversion(checkpoint, tuple(notes))


def _hf_tokenizer(src: Path, vocab: int) -> tuple[Path | None, list[str]]:
    """The folder's tokenizer.json when meshtron can use it, else None and why not."""
    path = src / "tokenizer.json"
    if not path.is_file():
        return None, [f"{src} has no tokenizer.json, so none was copied; `meshtron generate` "
                      "needs one in the checkpoint (a fast-tokenizer tokenizer.json)"]
    try:
        tokenizer = Tokenizer.load(path)
    except MeshtronError as err:
        return None, [f"tokenizer.json not copied, meshtron cannot use it: {err}"]
    if tokenizer.vocab_size > vocab:
        return None, [f"tokenizer.json not copied: its {tokenizer.vocab_size} tokens exceed the "
                      f"model's vocabulary of {vocab}"]
    return path, []


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder (one file, or the shards of an index)."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        _refuse_pickle(folder, _pickled_files(folder))
        raise MeshtronError(f"{folder} holds no model.safetensors or "
                            "model.safetensors.index.json")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            AttributeError):
        raise MeshtronError(f"{index} is not a valid safetensors index (no weight_map)") from None
    files = []
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(
                ".safetensors"):
            raise MeshtronError(f"{index} names a weight file that is not a safetensors file "
                                f"in {folder}: {name!r}")
        if not (folder / name).is_file():
            raise MeshtronError(f"{index} names {name}, which is missing from {folder}")
        files.append(folder / name)
    return files


def read_hf_tensors(folder: Path, cfg: ModelConfig) -> Tensors:
    """The HF tensors a model of ``cfg`` needs, checked by name and shape (from the file
    headers) before any is loaded; never unpickles."""
    stored: dict[str, tuple[Path, str, tuple[int, ...]]] = {}  # name -> file, key, shape
    try:
        for file in _weight_files(folder):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    stored[key] = (file, key, tuple(f.get_slice(key).get_shape()))
    except (SafetensorError, OSError) as err:
        raise MeshtronError(f"cannot read the safetensors weights in {folder}: {err}") from None
    prefix = "model." if cfg.arch == "llama" else "transformer."
    if not any(name.startswith(prefix) for name in stored):  # saved from the base model class
        stored = {(n if n.startswith("lm_head.") else prefix + n): v for n, v in stored.items()}
    expected = _expected_hf(cfg)
    for name, shape in expected.items():
        if name not in stored:
            raise MeshtronError(f"{folder} lacks tensor '{name}', which its config.json implies")
        if stored[name][2] != tuple(shape):
            raise MeshtronError(f"tensor '{name}' in {folder} has shape {stored[name][2]}, its "
                                f"config.json implies {tuple(shape)}")
    for name in sorted(stored):
        ignored = name.endswith(IGNORED_HF_TENSORS) or name == "lm_head.weight"
        if name not in expected and not ignored:
            raise MeshtronError(f"{folder} has tensor '{name}', which a model of its config.json "
                                "does not have")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(stored[name][0], []).append(name)
    out: Tensors = {}
    try:
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in names:
                    out[name] = f.get_tensor(stored[name][1])
    except (SafetensorError, OSError) as err:
        raise MeshtronError(f"cannot read the safetensors weights in {folder}: {err}") from None
    return out


# ----------------------------------------------------------------------------- meshtron -> hf


def export_hf(checkpoint: Path, dst: Path) -> Conversion:
    """Write the meshtron checkpoint ``checkpoint`` as an HF model folder ``dst``."""
    cfg, state = read_model_tensors(checkpoint)
    model_cfg = cfg.model
    for name, shape in _expected_state(model_cfg).items():
        if name not in state:
            raise MeshtronError(f"checkpoint {checkpoint} lacks parameter {name}")
        if state[name].shape != shape:
            raise MeshtronError(f"checkpoint {checkpoint}: parameter {name} has shape "
                                f"{tuple(state[name].shape)}, its config implies {tuple(shape)}")
    tokenizer_path = checkpoint / "tokenizer.json"
    tokenizer = Tokenizer.load(tokenizer_path) if tokenizer_path.is_file() else None
    config = hf_config_dict(model_cfg, state["embed.weight"].dtype,
                            tokenizer.eos_id if tokenizer else None)
    biased = [n for n in state if n.endswith(".router.expert_bias") and bool(state[n].any())]
    if biased:
        raise MeshtronError(f"checkpoint {checkpoint}: {biased[0]} is not zero (aux-loss-free "
                            "balancing), and Hugging Face Mixtral has no expert selection bias")
    hf = to_hf(state, model_cfg)
    if model_cfg.tie_embeddings:  # as save_pretrained does: the head is the embedding
        del hf["lm_head.weight"]
    tmp = dst.parent / f".tmp-{dst.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(hf, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    notes = []
    if tokenizer is not None:
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                            "eos_token": tokenizer.decode([tokenizer.eos_id]),
                            "model_max_length": model_cfg.max_seq_len}
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    else:
        notes.append(f"checkpoint {checkpoint} has no tokenizer.json, so none was written")
    os.replace(tmp, dst)
    return Conversion(dst, tuple(notes))
