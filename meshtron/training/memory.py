"""Activation memory measured, and what a device holds: the ground truth of the formula in
:mod:`meshtron.costmodel.activations` (the test suite checks one against the other), and the
check that a model's training state fits before anything is allocated."""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from meshtron.config import Config
from meshtron.errors import MeshtronError
from meshtron.models.flops import model_size
from meshtron.parallel.context.sequence import MicroBatch
from meshtron.parallel.mesh.layout import MeshLayout


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
