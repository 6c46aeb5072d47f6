"""Conversion between meshtron checkpoints and Hugging Face model folders.

``convert(src, dst, fmt)`` detects what ``src`` is (a Hugging Face folder with ``config.json``
and safetensors weights, or a meshtron run directory / checkpoint root / checkpoint) and writes
the other format to ``dst``:

* meshtron -> hf: ``config.json`` (``LlamaForCausalLM``, ``MixtralForCausalLM`` or
  ``GPT2LMHeadModel``), ``model.safetensors``, ``generation_config.json`` (the config's
  ``generation`` section) and, when the checkpoint has one, ``tokenizer.json`` with a minimal
  ``tokenizer_config.json``;
* hf -> meshtron: a weights-only checkpoint (``write_model_checkpoint``; its config's
  ``generation`` section from the folder's generation config, :mod:`.hf_generation`) plus
  ``train.yaml``, the settings that continue training from it, with the fine-tuning learning
  rate, warm-up and weight decay of :mod:`meshtron.config.finetune`.

Which Hugging Face family a model belongs to, and how its tensors and config fields map, is
each architecture's own description (:mod:`meshtron.models.arch`): Llama and Mistral (without a
binding sliding window) map to meshtron's ``llama`` arch, Mixtral to ``llama`` with every layer
a mixture of experts (``model.moe.*``), GPT-2 to ``gpt2``. A meshtron MoE model exports as
Mixtral only when Mixtral can compute it exactly (softmax top-k>1 routing, renormalised, no
shared experts, groups, dense layers, capacity or selection bias). This module handles the
folders and files; :mod:`.hf_config` the config.json, :mod:`.hf_mapping` the tensors.

Weights are read with safetensors only: pickled files (``pytorch_model.bin``, ``.pt``)
are refused, never opened. The vocabulary is kept exactly: ``vocab_multiple`` is chosen so the
padded size equals the HF vocab, so the logits of both models have the same shape and values.
Nothing here imports ``transformers``; its config files are read and written as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError, safe_open

from meshtron.checkpoint.hf_config import hf_config_dict, hf_model_config
from meshtron.checkpoint.hf_generation import (
    hf_generation_dict,
    read_hf_generation,
    read_json_object,
    silent_generation,
)
from meshtron.checkpoint.hf_mapping import (
    expected_state,
    from_hf,
    hf_format,
    hf_shapes,
    tensor_rules,
    to_hf,
)
from meshtron.checkpoint.loading import resolve_checkpoint
from meshtron.checkpoint.lora_merge import base_config, peft_folder
from meshtron.checkpoint.manifest import read_manifest, verify_file
from meshtron.checkpoint.model_io import model_config, read_model_tensors, write_model_checkpoint
from meshtron.checkpoint.shards import save_safetensors
from meshtron.config import Config, ModelConfig, config_from_dict
from meshtron.config.finetune import FINETUNE_TRAIN
from meshtron.data import Tokenizer
from meshtron.errors import MeshtronError
from meshtron.files import write_failure_reason
from meshtron.models.flops import padded_vocab_size
from meshtron.plan import check_model

Tensors = dict[str, torch.Tensor]
FORMATS = ("meshtron", "hf", "peft")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
IGNORED_HF_TENSORS = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")
"""Buffers some HF checkpoints carry that are recomputed, not learned."""
TRAIN_YAML_HEAD = ("# Written by `meshtron convert`: continue training (fine-tuning) this model "
                   "with\n#   meshtron train --config train.yaml --data.path=YOUR_TEXT\n"
                   "# train.lr, min_lr, warmup_steps and weight_decay are fine-tuning defaults "
                   "(meshtron/config/finetune.py);\n# change them here or override them on the "
                   "command line.\n")


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
    if fmt == "peft":
        return export_peft(src, dst, kind)
    return import_hf(src, dst) if kind == "hf" else export_hf(resolve_checkpoint(src), dst)


def export_peft(src: Path, dst: Path, kind: str) -> Conversion:
    """The adapters of a LoRA run or checkpoint as a PEFT folder (``--format peft``), for the
    Hugging Face export of its base (``--format hf`` of the base checkpoint)."""
    checkpoint = resolve_checkpoint(src) if kind == "meshtron" else src
    manifest = read_manifest(checkpoint) if kind == "meshtron" else {}
    if "lora" not in manifest:
        raise MeshtronError(f"{src} holds no LoRA adapters (model.lora.rank > 0): --format peft "
                            "writes a run's adapters")
    cfg = base_config(model_config(checkpoint, manifest))
    peft_folder(checkpoint, manifest, dst, tensor_rules(cfg.model))
    return Conversion(dst, (f"load it with peft.PeftModel.from_pretrained(model, '{dst}') on "
                            "the Hugging Face export of the base model",))


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


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """The tensors (and shapes) an HF folder of ``cfg``'s family holds."""
    hf = hf_shapes(cfg)
    if cfg.tie_embeddings:  # as save_pretrained does: the head is the embedding
        del hf[hf_format(cfg).head]
    return hf


# ----------------------------------------------------------------------------- hf -> meshtron


def import_hf(src: Path, dst: Path) -> Conversion:
    """Write the HF model in ``src`` as a meshtron checkpoint under ``dst``."""
    config_path = src / "config.json"
    hf = read_json_object(config_path)
    model_cfg = hf_model_config(hf, str(config_path))
    notes = []
    if model_cfg.mtp_depth and not _holds_layer(src, model_cfg.num_layers):
        notes.append(f"config.json counts {model_cfg.mtp_depth} multi-token-prediction layers but "
                     f"{src} holds none (as transformers saves them): imported without them "
                     "(model.mtp_depth=0)")
        model_cfg.mtp_depth = 0
    cfg = import_config(model_cfg, str(config_path))
    cfg.generation, generation_notes = read_hf_generation(src, hf)  # checked as it is read
    notes += generation_notes
    tensors = from_hf(read_hf_tensors(src, cfg.model), cfg.model)
    tokenizer, tokenizer_notes = _hf_tokenizer(src, padded_vocab_size(cfg.model))
    notes += tokenizer_notes
    jitter = hf.get("router_jitter_noise")
    if model_cfg.is_moe and jitter:
        notes.append(f"router_jitter_noise={jitter} was dropped: meshtron's router has no "
                     "input jitter (a training-time noise; the logits are unaffected)")
    return write_import(dst, cfg, tensors, tokenizer, notes)


def import_config(model_cfg: ModelConfig, where: str) -> Config:
    """The run config of an imported model (its sequence length capped by the model's), checked
    as training will check it; errors name ``where`` the model came from."""
    cfg = Config(model=model_cfg, generation=silent_generation())  # the HF import reads its own
    cfg.train.seq_len = min(cfg.train.seq_len, model_cfg.max_seq_len)
    try:
        cfg = config_from_dict(cfg.to_dict())
        check_model(cfg)
    except MeshtronError as err:
        raise MeshtronError(f"{where}: {err}") from None
    return cfg


def write_import(dst: Path, cfg: Config, tensors: Tensors, tokenizer: Path | None,
                 notes: list[str], extra_files: dict[str, str] | None = None) -> Conversion:
    """Write an imported model (meshtron names) as a weights-only checkpoint under ``dst``,
    with its tokenizer, ``extra_files`` (name -> text) beside it and the ``train.yaml`` that
    continues training from it. Shared by the HF and the GGUF import."""
    checkpoint = write_model_checkpoint(dst, cfg, tensors, tokenizer=tokenizer)
    settings: dict[str, Any] = {"model": cfg.to_dict()["model"],
                                "train": {"seq_len": cfg.train.seq_len, **FINETUNE_TRAIN},
                                "generation": cfg.to_dict()["generation"],
                                "checkpoint": {"dir": str(dst.resolve())},
                                "run": {"dir": str(dst.resolve())}}  # its own run, not runs/default
    if tokenizer is not None:  # outside step_* (which training may prune): a stable path
        shutil.copyfile(tokenizer, dst / "tokenizer.json")
        settings["data"] = {"tokenizer": str((dst / "tokenizer.json").resolve())}
    for name, text in (extra_files or {}).items():
        (dst / name).write_text(text)
    (dst / "train.yaml").write_text(TRAIN_YAML_HEAD + yaml.safe_dump(settings, sort_keys=False))
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
    if tokenizer.vocab_size > vocab:  # ids the embedding has no row for: another model's
        raise MeshtronError(f"{path} does not belong to these weights: its "
                            f"{tokenizer.vocab_size} tokens exceed the model's vocabulary of "
                            f"{vocab} embedding rows")
    return path, []


def _holds_layer(folder: Path, layer: int) -> bool:
    """Whether the folder's safetensors hold any tensor of layer ``layer`` (headers only)."""
    marker = f"layers.{layer}."
    try:
        for file in weight_files(folder):
            with safe_open(str(file), framework="pt") as f:
                if any(marker in key for key in f.keys()):  # noqa: SIM118 (not a mapping)
                    return True
    except (SafetensorError, OSError) as err:
        raise MeshtronError(f"cannot read the safetensors weights in {folder}: {err}") from None
    return False


def weight_files(folder: Path) -> list[Path]:
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
    except RecursionError:
        raise MeshtronError(f"{index} is nested too deeply to be a safetensors index") from None
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
        for file in weight_files(folder):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    stored[key] = (file, key, tuple(f.get_slice(key).get_shape()))
    except (SafetensorError, OSError) as err:
        raise MeshtronError(f"cannot read the safetensors weights in {folder}: {err}") from None
    fmt = hf_format(cfg)
    prefix = fmt.base_prefix
    if not any(name.startswith(prefix) for name in stored):  # saved from the base model class
        stored = {(n if n == fmt.head else prefix + n): v for n, v in stored.items()}
    expected = expected_hf_shapes(cfg)
    for name, shape in expected.items():
        if name not in stored:
            raise MeshtronError(f"{folder} lacks tensor '{name}', which its config.json implies")
        if stored[name][2] != tuple(shape):
            raise MeshtronError(f"tensor '{name}' in {folder} has shape {stored[name][2]}, its "
                                f"config.json implies {tuple(shape)}")
    for name in sorted(stored):
        ignored = name.endswith(IGNORED_HF_TENSORS) or name == fmt.head
        if name not in expected and not ignored:
            why = fmt.unexpected(cfg, name)
            raise MeshtronError(f"{folder} {why}" if why else f"{folder} has tensor '{name}', "
                                "which a model of its config.json does not have")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(stored[name][0], []).append(name)
    out: Tensors = {}
    try:
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in names:
                    out[name] = f.get_tensor(stored[name][1])
                    _check_finite(folder, name, out[name])
    except (SafetensorError, OSError) as err:
        raise MeshtronError(f"cannot read the safetensors weights in {folder}: {err}") from None
    return out


def _check_finite(folder: Path, name: str, tensor: torch.Tensor) -> None:
    """Weights that are NaN or infinite are refused: a model from them computes nothing."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise MeshtronError(f"tensor '{name}' in {folder} holds NaN or infinite values; "
                            "refusing to import it")


# ----------------------------------------------------------------------------- meshtron -> hf


def export_hf(checkpoint: Path, dst: Path) -> Conversion:
    """Write the meshtron checkpoint ``checkpoint`` as an HF model folder ``dst``."""
    cfg, state, tokenizer_path = read_export_state(checkpoint)
    model_cfg = cfg.model
    tokenizer = Tokenizer.load(tokenizer_path) if tokenizer_path is not None else None
    config = hf_config_dict(model_cfg, state["embed.weight"].dtype,
                            tokenizer.eos_id if tokenizer else None)
    hf = to_hf(state, model_cfg)
    if model_cfg.tie_embeddings:  # as save_pretrained does: the head is the embedding
        del hf[hf_format(model_cfg).head]
    files = {"config.json": json.dumps(config, indent=2) + "\n",
             "generation_config.json": json.dumps(hf_generation_dict(
                 cfg.generation, tokenizer.eos_id if tokenizer else None), indent=2) + "\n"}
    notes = []
    if tokenizer_path is not None and tokenizer is not None:
        files["tokenizer_config.json"] = json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": tokenizer.decode([tokenizer.eos_id]),
            "model_max_length": model_cfg.max_seq_len}, indent=2) + "\n"
    else:
        notes.append(f"checkpoint {checkpoint} has no tokenizer.json, so none was written")
    write_folder(dst, hf, files, tokenizer_path)
    return Conversion(dst, tuple(notes))


def write_folder(dst: Path, tensors: Tensors, files: dict[str, str],
                 tokenizer: Path | None) -> None:
    """Write the folder beside ``dst`` under a temporary name and rename it into place; a
    write the file system refuses (a full disk, a quota) removes the temporary folder and is
    one line, so a failed export leaves nothing behind."""
    tmp = dst.parent / f".tmp-{dst.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        for name, text in files.items():
            (tmp / name).write_text(text)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        os.replace(tmp, dst)
    except (OSError, SafetensorError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise MeshtronError(f"writing {dst} failed ({write_failure_reason(err)}); nothing was "
                            "left behind") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_export_state(checkpoint: Path) -> tuple[Config, Tensors, Path | None]:
    """(config, full state, verified tokenizer.json or None) of a checkpoint to export,
    refused when a parameter is missing or misshapen or when meshtron-only state (the
    aux-loss-free expert bias) is not zero, since the HF family has no tensor to hold it."""
    cfg, state = read_model_tensors(checkpoint)
    model_cfg = cfg.model
    for name, shape in expected_state(model_cfg).items():
        if name not in state:
            raise MeshtronError(f"checkpoint {checkpoint} lacks parameter {name}")
        if state[name].shape != shape:
            raise MeshtronError(f"checkpoint {checkpoint}: parameter {name} has shape "
                                f"{tuple(state[name].shape)}, its config implies {tuple(shape)}")
    manifest = read_manifest(checkpoint)
    tokenizer_path = None
    if "tokenizer.json" in manifest["files"] or (checkpoint / "tokenizer.json").exists():
        tokenizer_path = verify_file(checkpoint, manifest, "tokenizer.json")
    family = hf_format(model_cfg).model_types[0].display
    for rule in tensor_rules(model_cfg):
        unmapped = [name for name in rule.ours if not rule.theirs and bool(state[name].any())]
        if unmapped:
            raise MeshtronError(f"checkpoint {checkpoint}: {unmapped[0]} is not zero, and "
                                f"Hugging Face {family} has no tensor to hold it")
    return cfg, state, tokenizer_path
