"""Import a Hugging Face SigLIP vision tower into a :class:`~meshtron.models.vision.VisionEncoder`.

Reads a local folder as ``save_pretrained`` writes it (``config.json`` + safetensors): a
``SiglipVisionModel`` or a whole ``SiglipModel`` (its ``vision_config`` and ``vision_model.``
tensors; the text tower is not read). Tensors map by one table of
:class:`~meshtron.models.architecture.TensorRule` (several HF tensors concatenated into one
of ours: [q | k | v]); each rank keeps the slice its parameter's ``SliceSpec`` says, so any
tp layout loads the same global weights. The pooling head is not read (the encoder has none)
and the projector, which HF towers lack, keeps its initial values.

ViT (``ViTModel``) is refused: its class token adds a position the decoder reserves no place
for and its exact GELU differs from SigLIP's tanh GELU by ~1e-3; ``model.vision`` can say
neither, so a ViT import could not be computed exactly. SigLIP2 (NaFlex: variable resolution,
a linear embedding of packed patches, resized positions) is refused for the same reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from meshtron.checkpoint.hf_convert import weight_files
from meshtron.config import VisionConfig
from meshtron.errors import MeshtronError
from meshtron.models.architecture import HFConfig, TensorRule
from meshtron.models.vision import VisionEncoder
from meshtron.parallel.mesh import ParallelMesh
from meshtron.parallel.mesh.params import layout_of
from meshtron.parallel.tensor.layers import TPRegion

SIGLIP_VISION_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6)
"""``SiglipVisionConfig``'s class defaults, for config.json files that omit a field."""

FIELDS = (("image_size", "image_size"), ("patch_size", "patch_size"),
          ("channels", "num_channels"), ("hidden_size", "hidden_size"),
          ("num_layers", "num_hidden_layers"), ("num_heads", "num_attention_heads"),
          ("ffn_hidden_size", "intermediate_size"), ("norm_eps", "layer_norm_eps"))
"""(VisionConfig field, SigLIP config key): the encoder's settings an HF tower fixes."""

TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")
"""``transformers`` activations that compute the tanh approximation of GELU."""

LAYER_PREFIX = "encoder.layers.{i}."
LAYER_RULES = (
    TensorRule(("attn_norm.weight",), ("layer_norm1.weight",)),
    TensorRule(("attn_norm.bias",), ("layer_norm1.bias",)),
    TensorRule(("attn.qkv.weight",), ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                      "self_attn.v_proj.weight")),
    TensorRule(("attn.qkv.bias",), ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                    "self_attn.v_proj.bias")),
    TensorRule(("attn.proj.weight",), ("self_attn.out_proj.weight",)),
    TensorRule(("attn.proj.bias",), ("self_attn.out_proj.bias",)),
    TensorRule(("mlp_norm.weight",), ("layer_norm2.weight",)),
    TensorRule(("mlp_norm.bias",), ("layer_norm2.bias",)),
    TensorRule(("mlp.up.weight",), ("mlp.fc1.weight",)),
    TensorRule(("mlp.up.bias",), ("mlp.fc1.bias",)),
    TensorRule(("mlp.down.weight",), ("mlp.fc2.weight",)),
    TensorRule(("mlp.down.bias",), ("mlp.fc2.bias",)),
)
GLOBAL_RULES = (
    TensorRule(("patch_embed.weight",), ("embeddings.patch_embedding.weight",)),
    TensorRule(("patch_embed.bias",), ("embeddings.patch_embedding.bias",)),
    TensorRule(("pos_embed.weight",), ("embeddings.position_embedding.weight",)),
    TensorRule(("post_norm.weight",), ("post_layernorm.weight",)),
    TensorRule(("post_norm.bias",), ("post_layernorm.bias",)),
)
IGNORED = ("head.", "embeddings.position_ids")
"""HF tensors of the tower left unread: the pooling head, a non-learned buffer."""

VISION_PREFIX = "vision_model."
"""Where a ``SiglipModel`` (and ``SiglipVisionModel`` before transformers 5) keeps the tower."""


def _read_config(folder: Path) -> HFConfig:
    """The tower's config (a SiglipModel's ``vision_config``)."""
    if not folder.is_dir():
        raise MeshtronError(f"vision model folder not found: {folder}")
    path = folder / "config.json"
    if not path.is_file():
        raise MeshtronError(f"{folder} has no config.json: give a Hugging Face model folder "
                            "as save_pretrained writes it")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise MeshtronError(f"{path} cannot be read as JSON ({err})") from None
    if not isinstance(raw, dict):
        raise MeshtronError(f"{path} does not hold a JSON object")
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type.startswith("siglip2"):
        raise MeshtronError(f"{path}: SigLIP2 (model_type '{model_type}', NaFlex: variable "
                            "resolution over packed patches) is not supported; use a SigLIP "
                            "vision tower")
    if model_type == "vit":
        raise MeshtronError(f"{path}: ViT is not supported (its class token and exact GELU "
                            "have no place in model.vision); use a SigLIP vision tower")
    if model_type == "siglip":
        raw = raw.get("vision_config") or {}
        if not isinstance(raw, dict):
            raise MeshtronError(f"{path}: 'vision_config' is not a JSON object")
    elif model_type != "siglip_vision_model":
        raise MeshtronError(f"{path}: model_type {model_type!r} is not a vision tower meshtron "
                            "reads (SigLIP: 'siglip_vision_model' or 'siglip')")
    return HFConfig(raw, SIGLIP_VISION_DEFAULTS, str(path))


def _square(cfg: HFConfig, key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    cfg.require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"'{key}' must be a positive integer (square images and patches), got {value!r}")
    return value


def vision_config_from_hf(folder: Path) -> VisionConfig:
    """The ``model.vision`` encoder settings of the SigLIP tower in ``folder`` (the action
    fields stay unset, None); one line on anything the encoder cannot compute exactly."""
    cfg = _read_config(Path(folder))
    act = cfg.get("hidden_act")
    cfg.require(act in TANH_GELU, f"hidden_act {act!r} is not supported: the encoder's MLP "
                f"computes GELU with the tanh approximation ({', '.join(TANH_GELU)})")
    values: dict[str, Any] = {ours: cfg.get(theirs) for ours, theirs in FIELDS}
    values["image_size"], values["patch_size"] = _square(cfg, "image_size"), _square(
        cfg, "patch_size")
    channels, eps = values["channels"], values["norm_eps"]
    cfg.require(isinstance(channels, int) and not isinstance(channels, bool) and channels > 0,
                f"'num_channels' must be a positive integer, got {channels!r}")
    cfg.require(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0,
                f"'layer_norm_eps' must be a positive number, got {eps!r}")
    values["norm_eps"] = float(eps)
    cfg.require(values["image_size"] % values["patch_size"] == 0,
                f"image_size {values['image_size']} is not a multiple of patch_size "
                f"{values['patch_size']}")
    cfg.require(values["hidden_size"] % values["num_heads"] == 0,
                f"hidden_size {values['hidden_size']} is not divisible by num_attention_heads "
                f"{values['num_heads']}")
    return VisionConfig(**values)


def vision_rules(num_layers: int) -> list[TensorRule]:
    """Every rule with full names: ours relative to the encoder, theirs to the tower."""
    rules = [TensorRule(tuple(f"layers.{i}.{n}" for n in rule.ours),
                        tuple(LAYER_PREFIX.format(i=i) + n for n in rule.theirs))
             for i in range(num_layers) for rule in LAYER_RULES]
    return rules + list(GLOBAL_RULES)


def _stored(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """HF name -> (file, shape) from the safetensors headers (nothing loaded)."""
    stored = {}
    try:
        for file in weight_files(folder):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    stored[key] = (file, tuple(f.get_slice(key).get_shape()))
    except (SafetensorError, OSError) as err:
        raise MeshtronError(f"cannot read the safetensors weights in {folder}: {err}") from None
    return stored


def _check_matches(folder: Path, theirs: VisionConfig, ours: VisionConfig) -> None:
    for field, _ in FIELDS:
        if getattr(theirs, field) != getattr(ours, field):
            raise MeshtronError(f"{folder} holds a vision tower with {field}="
                                f"{getattr(theirs, field)}, the encoder was built with "
                                f"model.vision.{field}={getattr(ours, field)}")


def read_hf_vision(folder: Path, vision: VisionConfig) -> dict[str, torch.Tensor]:
    """The encoder's global tensors (names relative to the encoder, projector excluded) from
    the tower in ``folder``, checked by name and shape before any is loaded."""
    folder = Path(folder)
    _check_matches(folder, vision_config_from_hf(folder), vision)
    stored = _stored(folder)
    prefix = VISION_PREFIX if any(n.startswith(VISION_PREFIX) for n in stored) else ""
    tower = {n[len(prefix):]: v for n, v in stored.items() if n.startswith(prefix)}
    shapes = _hf_shapes(vision)
    for name, shape in shapes.items():
        if name not in tower:
            raise MeshtronError(f"{folder} lacks tensor '{prefix}{name}', which its config.json "
                                "implies")
        if tower[name][1] != shape:
            raise MeshtronError(f"tensor '{prefix}{name}' in {folder} has shape "
                                f"{list(tower[name][1])}, its config.json implies {list(shape)}")
    for name in sorted(tower):
        if name not in shapes and not name.startswith(IGNORED):
            raise MeshtronError(f"{folder} has tensor '{prefix}{name}', which a SigLIP vision "
                                "tower of its config.json does not have")
    hf: dict[str, torch.Tensor] = {}
    try:
        for file in {tower[name][0] for name in shapes}:
            with safe_open(str(file), framework="pt") as f:
                hf.update((n, f.get_tensor(prefix + n)) for n in shapes if tower[n][0] == file)
    except (SafetensorError, OSError) as err:
        raise MeshtronError(f"cannot read the safetensors weights in {folder}: {err}") from None
    out = {}
    for rule in vision_rules(vision.num_layers):
        (ours,) = rule.ours
        out[ours] = torch.cat([hf[name] for name in rule.theirs])
        if out[ours].is_floating_point() and not bool(torch.isfinite(out[ours]).all()):
            raise MeshtronError(f"tensor '{prefix}{rule.theirs[0]}' in {folder} holds NaN or "
                                "infinite values; refusing to import it")
    return out


def _hf_shapes(vision: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the tower of ``vision`` must hold, and its shape."""
    with torch.device("meta"):
        encoder = VisionEncoder(vision, vision.hidden_size, TPRegion(ParallelMesh.single().tp))
    ours = {name: tuple(p.shape) for name, p in encoder.named_parameters()}
    shapes = {}
    for rule in vision_rules(vision.num_layers):
        (name,) = rule.ours
        rows = ours[name][0] // len(rule.theirs)
        for theirs in rule.theirs:
            shapes[theirs] = (rows, *ours[name][1:])
    return shapes


@torch.no_grad()
def load_hf_vision(folder: Path, encoder: VisionEncoder) -> None:
    """Fill ``encoder``'s parameters from the SigLIP tower in ``folder``: each rank copies its
    slice of every global tensor (in the parameters' dtype); the projector and the readout
    token, which HF towers lack, are left as they are."""
    tensors = read_hf_vision(Path(folder), encoder.vision)
    for name, param in encoder.named_parameters():
        if name.startswith(("projector.", "readout.")):
            continue
        full = tensors[name]
        tp_slice = layout_of(param).tp_slice
        param.copy_(tp_slice.take(full) if tp_slice is not None else full)

