"""Name and layout mapping between meshtron's global parameters and Hugging Face models.

Pure tensor maps (no ``transformers`` import), read from each architecture's HF format (see
:mod:`meshtron.models.arch`): one table of :class:`~meshtron.models.architecture.TensorRule` per
architecture, applied one way by :func:`to_hf` and the other by :func:`from_hf`, so the two
are inverses by construction. The padded vocabulary rows are kept, so the HF model's vocab is
the padded size.
"""

from __future__ import annotations

from typing import Any

import torch

from meshtron.config import ModelConfig
from meshtron.errors import MeshtronError
from meshtron.models.arch import architecture_of
from meshtron.models.architecture import HFFormat, TensorRule
from meshtron.models.flops import padded_vocab_size
from meshtron.models.transformer import Transformer

Tensors = dict[str, torch.Tensor]


def hf_format(cfg: ModelConfig) -> HFFormat:
    """The HF family a model of ``cfg`` exports as (the first of its architecture's families
    that accepts it), or one line on why there is none."""
    arch = architecture_of(cfg)
    fmt = arch.hf_format_of(cfg)
    if fmt is None:
        raise MeshtronError(f"architecture '{arch.name}' has no Hugging Face format")
    if (reason := fmt.refusals(cfg)) is not None:
        raise MeshtronError(reason)
    if cfg.mtp_depth and not fmt.mtp_rules:
        raise MeshtronError(f"model.mtp_depth={cfg.mtp_depth}: this model exports as "
                            f"{fmt.model_types[0].display}, which has no multi-token-prediction "
                            "layers (DeepSeek-V3 has; set model.mtp_depth=0 to export without)")
    return fmt


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """Arguments for the ``transformers`` config class of ``cfg``'s HF family (``LlamaConfig``,
    ``MixtralConfig``, ``Qwen3Config``, ...)."""
    fmt = hf_format(cfg)
    fields = {theirs: getattr(cfg, ours) for ours, theirs in fmt.fields}
    return {"vocab_size": padded_vocab_size(cfg), **fields, **fmt.to_config(cfg)}


def tensor_rules(cfg: ModelConfig) -> list[TensorRule]:
    """Every rule of ``cfg``'s HF family with full names (layers and experts expanded) whose
    tensors the model has: a family's table names its optional tensors (biases, q/k norms,
    dense and expert MLPs), and each model keeps the ones it was built with."""
    fmt = hf_format(cfg)
    present = expected_state(cfg)
    experts = range(cfg.moe.num_experts if cfg.is_moe else 0)

    def expand(rule: TensorRule, ours: str, theirs: str) -> list[TensorRule]:
        copies = experts if any("{j}" in n for n in rule.ours) else [None]
        return [TensorRule(tuple(ours + n.format(j=j) for n in rule.ours),
                           tuple(theirs + n.format(j=j) for n in rule.theirs), rule.transpose)
                for j in copies]

    rules = []
    for i in range(cfg.num_layers + cfg.mtp_depth):  # multi-token prediction's layers last
        extra = fmt.mtp_rules if i >= cfg.num_layers else ()
        for rule in fmt.layer_rules + extra:
            rules += expand(rule, f"layers.{i}.", fmt.layer_prefix.format(i=i))
    for rule in fmt.global_rules:
        rules += expand(rule, "", "")
    return [rule for rule in rules if all(name in present for name in rule.ours)]


def expected_state(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Every parameter of a meshtron model of ``cfg`` and its shape (built on the meta device:
    no memory, no compute)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: t.shape for name, t in model.state_dict().items()}


def to_hf(state: Tensors, cfg: ModelConfig) -> Tensors:
    """A full meshtron state dict (global names) -> the HF model's state dict (its LM head is
    the embedding when tied, as in ``transformers``)."""
    fmt = hf_format(cfg)
    out: Tensors = {}
    for rule in tensor_rules(cfg):
        if not rule.theirs:  # meshtron-only state (an expert selection bias)
            continue
        full = torch.cat([state[name] for name in rule.ours])
        for name, piece in zip(rule.theirs, full.chunk(len(rule.theirs))):
            out[name] = piece.t() if rule.transpose else piece
    out[fmt.head] = state["embed.weight" if cfg.tie_embeddings else "output.weight"]
    for name, shared in mtp_copies(cfg, fmt).items():
        out[name] = (out[fmt.head] if shared == fmt.head else state[shared]).clone()
    return {k: v.contiguous() for k, v in out.items()}


def hf_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """The shape of every tensor :func:`to_hf` gives for ``cfg``, from the same rules but with
    no tensor op: ``to_hf`` on meta tensors runs ``torch.cat`` through Python references that
    import ``torch._dynamo`` (about 2 CPU-s in a process that only checks shapes)."""
    fmt = hf_format(cfg)
    ours = expected_state(cfg)
    out: dict[str, torch.Size] = {}
    for rule in tensor_rules(cfg):
        if not rule.theirs:
            continue
        rows = sum(ours[name][0] for name in rule.ours)
        rest = tuple(ours[rule.ours[0]][1:])
        size = -(-rows // len(rule.theirs))  # torch.chunk's piece: the last one may be short
        for i, name in zip(range(0, rows, size), rule.theirs):
            shape = (min(size, rows - i), *rest)
            out[name] = torch.Size(shape[::-1] if rule.transpose else shape)
    out[fmt.head] = ours["embed.weight" if cfg.tie_embeddings else "output.weight"]
    for name, shared in mtp_copies(cfg, fmt).items():
        out[name] = out[fmt.head] if shared == fmt.head else ours[shared]
    return out


def mtp_copies(cfg: ModelConfig, fmt: HFFormat) -> dict[str, str]:
    """HF name -> what it copies (``embed.weight``, or the HF head's name) of the embedding
    and head copies ``fmt`` keeps in each multi-token-prediction layer of ``cfg``."""
    if not cfg.mtp_depth or fmt.mtp_copies is None:
        return {}
    embedding, head = fmt.mtp_copies
    out = {}
    for i in range(cfg.num_layers, cfg.num_layers + cfg.mtp_depth):
        prefix = fmt.layer_prefix.format(i=i)
        out[prefix + embedding], out[prefix + head] = "embed.weight", fmt.head
    return out


def from_hf(hf: Tensors, cfg: ModelConfig) -> Tensors:
    """Inverse of :func:`to_hf` (an HF state dict -> meshtron global names); meshtron-only
    state starts at zero (fp32). A tensor that maps one to one is the input's own (or its
    transposed copy), not a copy: the imports hand over tensors they read for this."""
    fmt = hf_format(cfg)
    shapes = expected_state(cfg)
    out: Tensors = {}
    for rule in tensor_rules(cfg):
        if not rule.theirs:
            for name in rule.ours:
                out[name] = torch.zeros(shapes[name], dtype=torch.float32)
            continue
        parts = [hf[name].t() if rule.transpose else hf[name] for name in rule.theirs]
        full = parts[0] if len(parts) == 1 else torch.cat(parts)  # one part: no copy
        rows = [shapes[name][0] for name in rule.ours]
        out.update(zip(rule.ours, full.split(rows)))
    if not cfg.tie_embeddings:
        out["output.weight"] = hf[fmt.head]
    head = out["embed.weight"] if cfg.tie_embeddings else out["output.weight"]
    for name, shared in mtp_copies(cfg, fmt).items():
        original = head if shared == fmt.head else out[shared]
        if not torch.equal(hf[name], original):
            raise MeshtronError(f"tensor '{name}' differs from the model's "
                                f"{'LM head' if shared == fmt.head else 'embedding'}: meshtron's "
                                "multi-token prediction shares them, so it cannot be imported")
    return {k: v.contiguous() for k, v in out.items()}
