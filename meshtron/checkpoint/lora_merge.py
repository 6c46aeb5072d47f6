"""An adapter checkpoint as a whole model: its base's weights with every adapter merged in
(``W + alpha / rank * B A``, routed experts' weights one by one), so that generation,
``meshtron convert --format hf`` and GGUF export see one ordinary model; and as a PEFT
adapter folder (``--format peft``; not for adapters on routed experts).

The base comes from where the checkpoint's ``lora`` entry says (:mod:`.lora_state`): a
checkpoint, checked against the recorded digest, or weights drawn from ``train.seed``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from meshtron.checkpoint.lora_state import weights_digest
from meshtron.checkpoint.manifest import saved_config
from meshtron.checkpoint.shards import ShardReader, check_finite
from meshtron.checkpoint.store import open_checkpoint
from meshtron.config import Config, config_from_dict
from meshtron.config.lora_section import LoraConfig
from meshtron.errors import MeshtronError
from meshtron.models.adapters import seed_base
from meshtron.models.init import initial_value, width_multiplier
from meshtron.models.transformer import Transformer
from meshtron.parallel.mesh.params import global_names, layout_of

Tensors = dict[str, torch.Tensor]


def base_config(cfg: Config) -> Config:
    """``cfg`` without adapters: the model the merged weights are."""
    model = dataclasses.replace(cfg.model, lora=LoraConfig())
    return dataclasses.replace(cfg, model=model)


def adapter_config(path: Path, manifest: dict[str, Any]) -> Config:
    try:
        return config_from_dict(saved_config(path, manifest))
    except MeshtronError as err:
        raise MeshtronError(f"checkpoint {path} holds an invalid config: {err}") from None


def adapters(reader: ShardReader) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Layer name (``layers.0.attn.q``) -> its (A, B), whole."""
    names = sorted(n[len("model/"):-len(".lora.a")] for n in reader.tensors
                   if n.startswith("model/") and n.endswith(".lora.a"))
    return {n: (reader.read(f"model/{n}.lora.a"), reader.read(f"model/{n}.lora.b"))
            for n in names}


def base_tensors(path: Path, manifest: dict[str, Any], cfg: Config) -> Tensors:
    """The base model's whole weights, checked against the recorded digest."""
    record = manifest["lora"]
    if record.get("path") is None:
        found = seed_base(cfg.model, cfg.train.seed)["digest"]
        tensors = seed_weights(base_config(cfg))
    else:
        base = Path(record["path"])
        if not (base / "meta.json").is_file():
            raise MeshtronError(f"checkpoint {path} adapts the base model at {base}, which is "
                                "gone; restore it there to use the adapters")
        base_manifest, reader = open_checkpoint(base)
        found = weights_digest(base_manifest)
        tensors = {n[len("model/"):]: reader.read(n) for n in reader.tensors
                   if n.startswith("model/") and ".lora." not in n}
        reader.verify()
    if found != record["digest"]:
        raise MeshtronError(f"checkpoint {path} holds adapters of base model "
                            f"{record['digest'][7:19]}, but its base is now {found[7:19]}; "
                            "the adapters need the base they were trained on")
    return tensors


def seed_weights(cfg: Config) -> Tensors:
    """The weights a run of ``cfg`` starts from (models/init.py), whole."""
    m = cfg.model
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in Transformer(m).state_dict().items()}
    return {n: initial_value(n, shape, seed=cfg.train.seed, std=m.init_std,
                             num_layers=m.num_layers, width_mult=width_multiplier(m))
            for n, shape in shapes.items()}


def merged_model(path: Path, manifest: dict[str, Any]) -> tuple[Config, Tensors]:
    """The adapted model of checkpoint ``path`` as one model: (its config without adapters,
    the base's weights with ``alpha / rank * B A`` added, in fp64 then in their dtype)."""
    cfg = adapter_config(path, manifest)
    _, reader = open_checkpoint(path)
    pairs = adapters(reader)
    reader.verify()
    tensors = base_tensors(path, manifest, cfg)
    scale = cfg.model.lora.scale
    for layer, (a, b) in pairs.items():
        weight = tensors[f"{layer}.weight"]
        delta = scale * (b.double() @ a.double())
        tensors[f"{layer}.weight"] = (weight.double() + delta).to(weight.dtype)
    for name, tensor in tensors.items():
        check_finite(path, name, tensor)
    return base_config(cfg), tensors


def peft_folder(path: Path, manifest: dict[str, Any], dst: Path,
                rules: list[Any]) -> None:
    """A PEFT LoRA adapter folder (``adapter_config.json``, ``adapter_model.safetensors``)
    for the Hugging Face export of the base: fused projections ([k | v], [gate | up]) give
    each HF projection the shared A and its rows of B. ``rules``: the HF tensor rules of the
    base model (hf_mapping.tensor_rules)."""
    from safetensors.torch import save_file

    cfg = adapter_config(path, manifest)
    _, reader = open_checkpoint(path)
    pairs = adapters(reader)
    reader.verify()
    if any(".experts." in layer for layer in pairs):
        raise MeshtronError(f"checkpoint {path} has adapters on routed experts, which a PEFT "
                            "folder cannot hold (PEFT adapts fused 3-D expert weights, not "
                            "one matrix per expert); use --format hf to merge them")
    out: Tensors = {}
    modules: set[str] = set()
    for rule in rules:
        layer = rule.ours[0][: -len(".weight")]
        if len(rule.ours) != 1 or layer not in pairs or rule.transpose:
            continue
        a, b = pairs[layer]
        for theirs, rows in zip(rule.theirs, b.chunk(len(rule.theirs))):
            module = theirs[: -len(".weight")]
            modules.add(module.rsplit(".", 1)[-1])
            out[f"base_model.model.{module}.lora_A.weight"] = a.clone()  # one file each
            out[f"base_model.model.{module}.lora_B.weight"] = rows.contiguous()
    if len(out) != 2 * sum(len(r.theirs) for r in rules if r.ours[0][:-7] in pairs):
        raise MeshtronError(f"checkpoint {path}: some adapters have no Hugging Face name")
    lora = cfg.model.lora
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
              "target_modules": sorted(modules), "fan_in_fan_out": False,
              "use_rslora": False, "init_lora_weights": True,
              "base_model_name_or_path": (manifest["lora"].get("path") or "")}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    (dst / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def load_merged(path: Path, manifest: dict[str, Any], model: torch.nn.Module) -> None:
    """``model`` (built without adapters, any tp slice) loaded with the merged weights."""
    _, tensors = merged_model(path, manifest)
    for name, param in zip(global_names(model).values(), model.parameters()):
        full = tensors[name]
        spec = layout_of(param).tp_slice
        param.copy_(spec.take(full) if spec is not None else full)
