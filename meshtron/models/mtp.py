"""Multi-token prediction (DeepSeek-V3): ``model.mtp_depth`` = D modules after the decoder, the
k-th predicting the token k + 1 positions ahead of the next one::

    h_0 = the decoder's last hidden state (before its final norm)
    h_k = block_k(merge_k([embed_norm_k(embed(t_{i+k})) ; hidden_norm_k(h_{k-1})]))
    logits_k = head(head_norm_k(h_k))                         predicts t_{i+k+1}

Each module is a transformer block (global layer index num_layers + k - 1, so it is named and
sharded like one and has experts when the layers after ``moe.dense_layers`` have) with two
input norms, a merge projection 2h -> h and its own final norm; the embedding and the output
head are the model's own. Module k's token-loss sum is taken over the positions whose target
lies inside the window, divided like the main loss by the batch's token count, and enters the
objective as ``mtp_loss_weight / D`` times the sum over k. It rides on the main logits as an
attached loss (as the MoE balancing loss does), so the schedules, the pipeline and the loss
reduction are unchanged, and the reported ``loss`` stays the main model's; at inference (no
tokens ahead given) the modules do not run and the logits are those of the model without them.

Under a pipeline the modules sit on the last stage, which then also holds a copy of the
embedding (its gradient summed with the first stage's, as for tied weights). Under sp the merge
weight is replicated over tp (its gradient summed, each rank seeing its positions); under cp
each rank's tokens ahead follow its own chunks (:class:`~meshtron.parallel.context.sequence.
SequenceSplit` cuts them from the whole window).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshtron.autograd import in_backward
from meshtron.config import ModelConfig
from meshtron.models.architecture import Architecture
from meshtron.models.blocks import Block, make_norm
from meshtron.models.rotary import Rotary
from meshtron.parallel.context.sequence import Sequence
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.tensor.collectives import all_reduce
from meshtron.parallel.tensor.layers import TPRegion, replicated
from meshtron.parallel.tensor.linear import LinearMode, linear


class MTPLayer(Block):
    """One multi-token-prediction module: a block with the input norms, the merge projection
    and the final norm of its prediction."""

    def __init__(self, cfg: ModelConfig, layer: int, arch: Architecture, region: TPRegion,
                 mesh: ParallelMesh, mode: LinearMode, selective_recompute: bool,
                 aux_loss_weight: Callable[[], float]):
        super().__init__(cfg, layer, arch, region, mesh, mode, selective_recompute,
                         aux_loss_weight)
        h = cfg.hidden_size
        self.embed_norm = make_norm(cfg, arch, region)
        self.hidden_norm = make_norm(cfg, arch, region)
        self.merge = nn.Module()
        self.merge.weight = replicated(nn.Parameter(torch.empty(h, 2 * h)), region)
        self.head_norm = make_norm(cfg, arch, region)
        self.grad_store = mode.grad_store

    def predict(self, hidden: torch.Tensor, embedded: torch.Tensor, rotary: Rotary | None,
                sequence: Sequence | None) -> torch.Tensor:
        """The module's hidden state from the previous one's and the embedded tokens ahead."""
        merged = torch.cat([self.embed_norm(embedded), self.hidden_norm(hidden)], dim=-1)
        return super().forward(linear(merged, self.merge.weight, None, self.grad_store),
                               rotary, None, sequence)


class MTPLosses:
    """The token-loss sums of each module over this rank's micro-batches of a step (fp64,
    on the device, so no forward waits for them)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.sums: torch.Tensor | None = None

    def add(self, losses: torch.Tensor) -> None:
        if in_backward():  # a forward recomputed in backward: counted already
            return
        losses = losses.detach().double()
        self.sums = losses if self.sums is None else self.sums + losses

    @torch.no_grad()
    def step_metrics(self, mesh: ParallelMesh, global_tokens: int,
                     device: torch.device) -> dict[str, float]:
        """``mtp/loss`` (the mean over modules of each one's token loss) and ``mtp/loss_k``,
        identical on every rank, and reset for the next step. Every rank calls it (the sums
        live on the last pipeline stage; tp ranks hold the same values)."""
        sums = self.sums if self.sums is not None else torch.zeros(self.depth,
                                                                   dtype=torch.float64,
                                                                   device=device)
        self.sums = None
        all_reduce(sums, mesh.dp_cp)
        all_reduce(sums, mesh.pp)
        losses = (sums / global_tokens).tolist()
        return {"mtp/loss": sum(losses) / self.depth,
                **{f"mtp/loss_{k + 1}": value for k, value in enumerate(losses)}}
