"""The decoder-only transformer, written once for every architecture and every layout.

The model only knows the parallel layer types it is built from (column/row-parallel linears, a
vocab-parallel embedding and loss) and the tensor-parallel region it runs in; on a one-process
mesh those layers are plain linears and the region's communication is a no-op. What it is made
of comes from its :class:`~meshtron.models.architecture.Architecture`; everything about how this
rank builds and runs it (its pipeline stage's layers, recompute, FP8, deferred weight
gradients, the MoE losses' gradient weight) from :class:`ModelOptions`, fixed at construction.

Parameter names are global and layout-free (``layers.{i}.attn.q.weight`` with ``i`` the global
layer index); checkpoints, initialisation and HF conversion all key on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshtron.autograd import attach_loss
from meshtron.config import ModelConfig
from meshtron.config.kinds import model_kind
from meshtron.models.adapters import attach_adapters
from meshtron.models.arch import architecture_of
from meshtron.models.blocks import Block, KVCache, make_norm
from meshtron.models.flops import padded_vocab_size
from meshtron.models.init import width_multiplier
from meshtron.models.input_encoder import InputEncoder, ModelInputs, place_inputs
from meshtron.models.modalities import build_input_encoders
from meshtron.models.moe import MoE
from meshtron.models.mtp import MTPLayer, MTPLosses
from meshtron.models.rotary import Rotary
from meshtron.parallel.context.sequence import Sequence
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.mesh.params import tie_across_pipeline
from meshtron.parallel.pipeline.partition import StageLayers
from meshtron.parallel.tensor.collectives import local_chunk
from meshtron.parallel.tensor.layers import (
    ColumnParallelLinear,
    TPRegion,
    VocabParallelEmbedding,
    entered_products,
    replicated,
)
from meshtron.parallel.tensor.linear import FP8Options, LinearMode, linear
from meshtron.parallel.tensor.loss import vocab_parallel_loss_sum
from meshtron.parallel.tensor.weight_grad import WeightGradStore


def no_aux_gradient() -> float:
    return 0.0


@dataclass(frozen=True)
class ModelOptions:
    """How this rank builds and runs its part of the model."""

    stage: StageLayers | None = None
    """This pipeline stage's layers; None: the whole model."""
    recompute: str = "none"
    """``full`` recomputes whole layers in backward, ``selective`` only attention cores."""
    fp8: Callable[[], FP8Options] | None = None
    """FP8 options for each linear layer of the blocks (a new object per layer)."""
    split_weight_grads: bool = False
    """Let the linear layers defer weight gradients (zero-bubble pipelines): the model then
    owns a :class:`WeightGradStore` as ``grad_store``."""
    aux_loss_weight: Callable[[], float] = no_aux_gradient
    """The gradient the MoE auxiliary losses get per unit, read at each forward: the weight of
    the language-model loss sum (loss scale / global tokens)."""
    compile: bool = False
    """``torch.compile`` each decoder block (lazily: at its first call), or where the block
    communicates its communication-free parts (:meth:`Block.compile_parts`)."""
    tp_comm_chunks: int = 0
    """Under sequence parallelism, pieces per rank of the all-gathers and reduce-scatters
    overlapped with the products beside them (0: not overlapped; see parallel/tensor/overlap)."""


WHOLE_MODEL = ModelOptions()


class Transformer(nn.Module):
    """Token ids [batch, seq] -> this rank's logits [batch, seq, padded vocab / tp].

    Under sequence parallelism the residual stream between blocks holds seq / tp positions per
    rank; the embedding reduce-scatters into it and the output layer gathers out of it.

    On a pipeline stage the module holds only that stage's chunks of layers (``layers`` is
    keyed by the global layer index), the embedding only on the first stage and the final norm
    and output layer only on the last; ``forward(x, chunk=c)`` runs one chunk, taking token ids
    into the first chunk of the model and hidden states into the others. With tied embeddings
    and several stages the last stage keeps a copy of the embedding as its output weight
    (global name ``embed.weight``); the two copies' gradients are summed over
    ``mesh.pipeline_ends`` so they stay equal.

    A model that reads more than tokens (its kind's ``inputs``) holds, on its first stage, one
    :class:`~meshtron.models.input_encoder.InputEncoder` per input as a submodule of the
    input's name (a vision-language-action policy's ``vision``), chosen by its kind
    (:mod:`meshtron.models.modalities`); ``forward(inputs=)`` hands them their inputs.
    """

    def __init__(self, cfg: ModelConfig, mesh: ParallelMesh | None = None,
                 options: ModelOptions = WHOLE_MODEL):
        super().__init__()
        mesh = mesh or ParallelMesh.single()
        arch = architecture_of(cfg)
        region = TPRegion(mesh.tp, mesh.layout.sequence_parallel, options.tp_comm_chunks)
        stage = options.stage or StageLayers((tuple(range(cfg.num_layers)),), True, True)
        self.cfg = cfg
        self.region = region
        self.vocab_size = cfg.vocab_size
        self.padded_vocab = padded_vocab_size(cfg)
        self.chunks = [list(chunk) for chunk in stage.chunks]
        self.has_embedding, self.has_head = stage.embedding, stage.head
        self.recompute = options.recompute
        self.grad_store = WeightGradStore() if options.split_weight_grads else None
        self.mtp_depth = cfg.mtp_depth if self.has_head else 0
        self.mtp_losses = MTPLosses(cfg.mtp_depth)
        self.aux_loss_weight = options.aux_loss_weight
        self.masked_targets = model_kind(cfg).masked_targets
        # muP's readout multiplier 1/m; with tied embeddings the only muP change at the output
        # (the shared weight keeps the embedding's init and learning rate)
        self.logit_scale = 1.0 / width_multiplier(cfg)
        self.logit_softcap = cfg.logit_softcap
        # Gemma: sqrt(hidden) in fp32, as transformers keeps it (then in the model's dtype)
        self.embed_scale = float(torch.tensor(cfg.hidden_size ** 0.5, device="cpu")) \
            if arch.embed_scale else None
        if self.has_embedding or self.mtp_depth:  # multi-token prediction embeds tokens ahead
            self.embed = VocabParallelEmbedding(self.padded_vocab, cfg.hidden_size, region)
        encoders = build_input_encoders(cfg, region) if self.has_embedding else {}
        for name, encoder in encoders.items():  # before the positions: the parameters' order
            self.add_module(name, encoder)
        self.input_names = tuple(encoders)
        self.rotary: Rotary | None = None
        if arch.rotary:
            self.rotary = arch.attention.rotary(cfg)
        elif self.has_embedding:
            self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
            replicated(self.pos_embed.weight, region)
        mode = LinearMode(options.fp8, self.grad_store)
        self.layers = nn.ModuleDict({
            str(i): Block(cfg, i, arch, region, mesh, mode, options.recompute == "selective",
                          options.aux_loss_weight, stage.parts(i))
            for chunk in self.chunks for i in chunk})
        if options.compile:  # per block, as TorchTitan: one graph serves every layer
            quiet = mesh.tp.pg is None and mesh.cp.pg is None
            for i, block in self.layers.items():
                block.compile_parts(whole=quiet and not cfg.is_moe_layer(int(i)))
        for i in range(cfg.num_layers, cfg.num_layers + self.mtp_depth):
            self.layers[str(i)] = MTPLayer(cfg, i, arch, region, mesh, mode,
                                           options.recompute == "selective",
                                           options.aux_loss_weight)
        if self.has_head:
            self.final_norm = make_norm(cfg, arch, region)
            if not cfg.tie_embeddings or not hasattr(self, "embed"):
                self.output = ColumnParallelLinear(cfg.hidden_size, self.padded_vocab, False,
                                                   region)
        # the embedding and the head on two stages (on one, zb-v's stage 0: one weight)
        two_ends = mesh.pp.size > 1 and self.has_embedding != self.has_head
        if two_ends and (cfg.tie_embeddings or cfg.mtp_depth):  # the embedding at both ends
            tied = self.embed.weight if hasattr(self, "embed") else self.output.weight
            tie_across_pipeline(tied, mesh.pipeline_ends,
                                None if self.has_embedding else "embed.weight")
        self.lora_base: dict[str, str | None] | None = None
        """An adapted model's base (path, digest): set by build_rank and checkpoint loading."""
        if cfg.lora.enabled:  # last: everything built before is frozen
            attach_adapters(self, iter(self.blocks()), cfg.lora, region)

    def blocks(self) -> list[Block]:
        """This rank's transformer blocks in the order its forward passes run them."""
        return [self.layers[str(i)] for chunk in self.chunks for i in chunk]

    def input_encoders(self) -> dict[str, InputEncoder]:
        """This rank's input encoders by the name of the input each reads (first stage only)."""
        return {name: getattr(self, name) for name in self.input_names}

    def moe_layers(self) -> dict[int, MoE]:
        """This rank's mixture-of-experts layers by global layer index."""
        return {int(i): block.mlp for i, block in self.layers.items()
                if block.has_mlp and isinstance(block.mlp, MoE)}

    def mtp_layers(self) -> list[MTPLayer]:
        """The multi-token-prediction modules this rank runs (on the last stage), in order."""
        return [self.layers[str(self.cfg.num_layers + k)] for k in range(self.mtp_depth)]

    @property
    def output_weight(self) -> torch.Tensor:
        if self.cfg.tie_embeddings and hasattr(self, "embed"):
            return self.embed.weight
        return self.output.weight

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty cache for ``batch`` sequences of up to ``max_len`` tokens, shaped by the
        attention (keys and values, or latent attention's latent and rotary key)."""
        p = self.output_weight
        return self.blocks()[0].attn.new_cache(self.cfg.num_layers, batch, max_len, p.dtype,
                                               p.device)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, chunk: int = 0,
                sequence: Sequence | None = None, ahead: torch.Tensor | None = None,
                inputs: ModelInputs | None = None) -> torch.Tensor:
        """Logits of token ids ``x``; in a pipeline, chunk ``chunk`` of this stage: token ids
        or hidden states in, hidden states or (from the model's last chunk) logits out.
        ``sequence`` says where the tokens sit when the sequence is split over cp or holds
        masked documents (None: positions 0.. of a plain causal sequence). ``ahead``
        [mtp_depth + 1, b, s], the targets and the tokens after them (-1 past the window's
        end), runs the multi-token-prediction modules, whose loss rides on the logits.
        ``inputs``: the model's inputs besides token ids by name (its kind's), read on the
        first chunk: each input encoder's tokens take the place of the token embeddings at
        its positions (see place_inputs)."""
        new_tokens = x.shape[1]
        if self.has_embedding and chunk == 0:
            start = cache.length if cache is not None else 0
            tokens, x = x, self.embed_tokens(x, start, sequence)
            x = self.place_inputs(x, inputs, start, tokens)
        for i in self.chunks[chunk]:
            block = self.layers[str(i)]
            if self.recompute == "full" and self.training:
                x = checkpoint(block, x, self.rotary, None, sequence, use_reentrant=False)
            else:
                x = block(x, self.rotary, cache, sequence)
        if not (self.has_head and chunk == len(self.chunks) - 1):
            return x
        if cache is not None:  # generation: one process, one chunk
            cache.length += new_tokens
        logits = self.readout(self.final_norm(x))
        if ahead is not None and self.mtp_depth:
            logits = self._predict_ahead(x, logits, ahead, sequence)
        return logits

    def _predict_ahead(self, hidden: torch.Tensor, logits: torch.Tensor, ahead: torch.Tensor,
                       sequence: Sequence | None) -> torch.Tensor:
        """Run the multi-token-prediction modules from the decoder's last hidden state and
        attach their weighted loss to the main logits (see :mod:`meshtron.models.mtp`)."""
        losses = []
        for k, layer in enumerate(self.mtp_layers(), start=1):
            embedded = self.embed(ahead[k - 1].clamp(min=0))  # -1 past the end: masked below
            if self.recompute == "full" and self.training:
                hidden = checkpoint(layer.predict, hidden, embedded, self.rotary, sequence,
                                    use_reentrant=False)
            else:
                hidden = layer.predict(hidden, embedded, self.rotary, sequence)
            keep = ahead[k] >= 0
            normed = self.region.enter(layer.head_norm(hidden))[keep]
            out = self.readout(normed, entered=True)
            losses.append(self.loss_sum(out, ahead[k][keep]))
        total = torch.stack(losses)
        self.mtp_losses.add(total)
        weight = self.aux_loss_weight() * self.cfg.mtp_loss_weight / self.mtp_depth
        if total.requires_grad and weight:
            logits = attach_loss(logits, total.sum(), weight)
        return logits

    def readout(self, x: torch.Tensor, entered: bool = False) -> torch.Tensor:
        """The output layer on normed hidden states (``entered``: already in the tp region),
        times muP's 1/m where ``model.mup`` sets it, soft-capped where ``model.logit_softcap``
        sets it (elementwise: each tp rank caps its own share of the vocabulary)."""
        if entered:
            logits = linear(x, self.output_weight, None, self.grad_store)
        elif self.region.overlapped:
            logits = entered_products(self.region, x, (self.output_weight,), (None,))[0]
        else:
            logits = linear(self.region.enter(x), self.output_weight, None, self.grad_store)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def embed_tokens(self, tokens: torch.Tensor, start: int,
                     sequence: Sequence | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if self.rotary is None:
            if sequence is None:
                index = torch.arange(start, start + tokens.shape[1], device=tokens.device)
                positions, seq_dim = self.pos_embed(index), 0
            else:
                positions, seq_dim = self.pos_embed(sequence.positions), 1
            if self.region.sequence_parallel:
                positions = local_chunk(positions, self.region.group, dim=seq_dim)
            x = x + positions
        return F.dropout(x, self.cfg.dropout, self.training)

    def place_inputs(self, x: torch.Tensor, inputs: ModelInputs | None, start: int,
                     tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``x`` of positions ``start..`` with each input encoder's tokens at
        its positions; ``tokens``: the window's ids (whole under sp)."""
        return place_inputs(self.input_encoders(), x, inputs, start, tokens, self.region)

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of token cross-entropies in fp32; padded vocabulary entries never count, nor,
        in a model whose kind masks its targets (a vision-language-action policy's: everything
        but the actions), targets below 0."""
        if self.masked_targets:
            keep = targets >= 0
            logits, targets = logits[keep], targets[keep]
        start = self.region.group.rank * logits.shape[-1]
        return vocab_parallel_loss_sum(logits, targets, self.region.group, start,
                                       self.vocab_size)
