"""Activation memory: what one transformer block keeps for backward, by formula and measured.

The formula counts the tensors this implementation saves per block and micro-batch (the
analogue of Korthikanti et al.'s 34·sbh + 5·as²b for Megatron's GPT in fp16), with b·s = N
tokens, h hidden, a/t query and k kv heads of size d on this rank, f/t FFN units, in elements:

- each of the two norms: its normalised input, the 1/rms per token, and its output as saved by
  the projections that read it — under sequence parallelism the first two hold N/t tokens and
  the third is the all-gathered full sequence;
- attention: rotated q and k, the kv projection output (v lives in it), the output and the
  log-sum-exp of each query row: N·(a/t)·d·2 + N·k·d·3 + N·a/t (the s×s score matrix is never
  stored: SDPA's flash kernels recompute it);
- SwiGLU: gate, up, silu(gate) and their product: 4·N·f/t.

``selective`` recompute drops the log-sum-exp (the attention core is recomputed; its inputs
and output stay alive anyway), ``full`` keeps only each block's input: N/t·h under SP, N·h
without. The test suite checks the formula against :func:`measure_saved_bytes`.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from meshtron.config import Config, ModelConfig
from meshtron.errors import MeshtronError
from meshtron.models.arch import architecture_of
from meshtron.models.flops import model_size
from meshtron.parallel.context.sequence import MicroBatch
from meshtron.parallel.mesh.layout import MeshLayout


def formula_covers(cfg: ModelConfig) -> bool:
    """The formula counts dense blocks of RMSNorm, rotary grouped-query attention and SwiGLU
    without biases (nor Gemma's norms after attention and MLP); MoE layers keep
    routing-dependent amounts, so no formula covers them."""
    arch = architecture_of(cfg)
    return (arch.norm_vectors == 1 and arch.rotary and arch.gated_mlp and not arch.bias
            and not arch.post_norms and not cfg.is_moe and not cfg.latent_attention)


def activation_bytes_per_layer(cfg: ModelConfig, micro_batch: int, seq_len: int, tp: int = 1,
                               sp: bool = False, recompute: str = "none",
                               element_size: int = 4) -> int:
    """Bytes one llama block keeps for backward per micro-batch on one tensor-parallel rank."""
    n = micro_batch * seq_len
    h = cfg.hidden_size
    d = cfg.head_size
    heads = cfg.num_heads // tp
    kv_heads = cfg.num_kv_heads // min(tp, cfg.num_kv_heads)
    ffn = cfg.ffn_hidden_size // tp
    local = n // tp if sp else n  # tokens of the residual stream held on this rank
    if recompute == "full":
        return element_size * local * h
    norm = local * h + local + n * h
    attention = 2 * n * heads * d + 3 * n * kv_heads * d + n * heads
    if recompute == "selective":
        attention -= n * heads
    mlp = 4 * n * ffn
    return element_size * (2 * norm + attention + mlp)


def measure_saved_bytes(model: nn.Module, batch: torch.Tensor | MicroBatch) -> int:
    """Bytes of distinct storages autograd keeps for backward in one forward + loss of
    ``batch`` (token windows [b, S + 1], or a rank's micro-batch).

    Parameters and buffers are not activations and are left out. Tensors saved inside an
    activation-checkpointed region are invisible here, so measure with recompute off.
    """
    skip = {t.untyped_storage().data_ptr()
            for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    mb = batch if isinstance(batch, MicroBatch) else MicroBatch(batch[:, :-1], batch[:, 1:])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.loss_sum(model(mb.tokens, sequence=mb.sequence), mb.targets)
    return sum(seen.values())


STATE_BYTES_PER_PARAM = 16
"""fp32 weights, gradients and AdamW's two moments: the least a trained parameter costs."""


def device_memory_bytes(device: torch.device) -> int:
    """What the device holds: a GPU's memory, or this machine's for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_state_fits(cfg: Config, layout: MeshLayout, device: torch.device) -> None:
    """Refuse, before anything is allocated, a model whose weights, gradients and AdamW state
    alone (fp32, split over tp x pp, experts over ep) exceed the device's memory: it could only
    fail later, deep inside an allocation."""
    m = cfg.model
    model = dataclasses.replace(m, vocab_size=m.vocab_size or cfg.data.vocab_size)
    size = model_size(model)
    ways = layout.tp * layout.pp * cfg.parallel.ep  # a lower bound: ep splits experts only
    needed = size.params / ways * STATE_BYTES_PER_PARAM
    have = device_memory_bytes(device)
    if needed > have:
        raise MeshtronError(
            f"the model's {size.params:,.0f} parameters need at least {needed / 2**30:,.1f} GiB "
            f"per rank for fp32 weights, gradients and AdamW state (split tp*pp*ep = {ways} "
            f"ways), and {device.type} memory here is "
            f"{have / 2**30:,.1f} GiB; use a smaller model or more tp/pp")
