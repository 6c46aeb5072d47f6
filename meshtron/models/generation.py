"""Autoregressive sampling with a KV cache, on one process or on one model replica spread
over tp x pp ranks: temperature, top-k and nucleus (top-p), batched prompts, EOS, stop rules
and token budgets per sequence, and a hook after each step (for streaming).

Under tensor parallelism each rank runs its heads and keeps the cache of its kv heads, as the
weights are split. Under pipeline parallelism each stage keeps the cache of its own layers and
the hidden states go stage to stage by point-to-point sends: one micro-batch, the stages in
turn (a pipeline here is for fitting a model, not for speed). The last stage gathers the
vocabulary-parallel logits, its first tp rank samples, and the next tokens are broadcast to
every rank; every rank then decides the same stops from the same tokens.

Prompts of different lengths are left-padded. Each sequence's positions start at 0 at its
first real token and the cache's ``keep`` mask hides the padding from real tokens, so a
sequence gets the tokens it gets alone (up to the rounding of batched products; a MoE with a
capacity factor routes the batch together, so there it may differ).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtron.errors import MeshtronError
from meshtron.models.blocks import KVCache
from meshtron.models.transformer import Transformer
from meshtron.parallel.context.sequence import Sequence
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.parallel.tensor.collectives import all_gather

PAD_ID = 0
"""The token left padding holds (masked, so any valid id does)."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    """0 is greedy decoding."""
    top_k: int = 0
    """0 disables top-k filtering."""
    top_p: float = 1.0
    """1 disables nucleus filtering."""
    seed: int = 0


GREEDY = Sampling(temperature=0.0)


@dataclass
class Completion:
    tokens: list[int]
    """The new tokens (EOS not included)."""
    finish: str = "length"
    """``eos``, ``stop`` (the stop rule said so) or ``length`` (max tokens or positions)."""


@dataclass(frozen=True)
class GenerationStats:
    prompts: int
    new_tokens: int
    """New tokens over all sequences."""
    first_token_s: float
    """Prefill and the first sampled token (time to first token)."""
    total_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first ones (the decode steps alone)."""
        later, seconds = self.new_tokens - self.prompts, self.total_s - self.first_token_s
        return later / seconds if later > 0 and seconds > 0 else 0.0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p nucleus to -inf (last dim is the vocabulary)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        sorted_logits = sorted_logits.masked_fill(before > top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits`` [b, vocab] (fp32)."""
    if sampling.temperature <= 0:
        return logits.argmax(-1)
    logits = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]


StopRule = Callable[[list[int]], bool]
"""Given a sequence's new tokens so far: whether it is finished (e.g. a stop string)."""
StepHook = Callable[[list[Completion], list[bool]], None]
"""Called after each step with every sequence's completion so far and whether it has ended
(a server streams from it)."""


class Generator:
    """Generation on this rank's part of the model (``model`` built for ``mesh``, cp = 1).
    Every rank of the mesh calls :meth:`generate` with the same arguments and gets the same
    completions; data-parallel replicas, if any, each compute them alike."""

    def __init__(self, model: Transformer, mesh: ParallelMesh | None = None):
        self.model = model.eval()
        self.mesh = mesh or ParallelMesh.single()
        weight = next(p for p in model.parameters() if p.dim() == 2)  # a product's weight
        self.dtype, self.device = weight.dtype, weight.device
        pp = self.mesh.pp
        self.first, self.last = pp.rank == 0, pp.rank == pp.size - 1
        last_stage = pp.ranks[-1]
        self.sampler = next(g for g in self.mesh.layout.groups(("tp",)) if last_stage in g)[0]
        """The global rank that samples: the first tp rank of this replica's last stage."""

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A cache for this stage's attention layers only (the others get empty
        placeholders; a stage may hold a layer's MLP half alone)."""
        own = {block.attn.layer: block.attn for block in self.model.blocks()
               if block.has_attention}
        cache = KVCache(0, batch, 0, max_len, 0, self.dtype, self.device)
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for layer in range(self.model.cfg.num_layers):
            part = own[layer].new_cache(1, batch, max_len, self.dtype, self.device) \
                if layer in own else None
            cache.keys.append(part.keys[0] if part else empty)
            cache.values.append(part.values[0] if part else empty)
        return cache

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int],
                 sampling: Sampling = GREEDY, eos_id: int | tuple[int, ...] | None = None,
                 stop: StopRule | list[StopRule | None] | None = None,
                 on_step: StepHook | None = None) -> tuple[list[Completion], GenerationStats]:
        """Continue every prompt by up to ``max_new_tokens`` tokens (one budget for all or one
        per prompt; fewer where the model's positions end), each stopping at ``eos_id`` (or any
        of several) or when ``stop`` (one rule for all or one per prompt) says so. An empty
        prompt starts from the (first) ``eos_id`` (or token 0)."""
        max_len = self.model.cfg.max_seq_len
        ends = (eos_id,) if isinstance(eos_id, int) else tuple(eos_id or ())
        prompts = [list(p) or [ends[0] if ends else 0] for p in prompts]
        for i, prompt in enumerate(prompts):
            if len(prompt) >= max_len:
                raise MeshtronError(
                    f"prompt {i + 1} takes {len(prompt)} tokens: the model has {max_len} "
                    "positions (model.max_seq_len) and needs one for a new token")
        budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) \
            else list(max_new_tokens)
        stops = list(stop) if isinstance(stop, list) else [stop] * len(prompts)
        longest = max(len(p) for p in prompts)
        max_new = min(max(budgets), max_len - longest)
        pads = torch.tensor([longest - len(p) for p in prompts], device=self.device)
        tokens = torch.tensor([[PAD_ID] * (longest - len(p)) + p for p in prompts],
                              device=self.device)
        cache = self.new_cache(len(prompts), longest + max_new)
        padded = bool(pads.any())
        if padded:
            cache.keep = torch.arange(longest + max_new, device=self.device)[None] >= pads[:, None]
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed)
        out = [Completion([]) for _ in prompts]
        done = [budget <= 0 for budget in budgets]
        begin = time.perf_counter()
        first = None
        for _ in range(max_new if not all(done) else 0):
            sequence = self._sequence(cache.length, tokens.shape[1], pads) if padded else None
            next_ids = self._step(tokens, cache, sequence, sampling, gen)
            first = first if first is not None else time.perf_counter() - begin
            for i, token in enumerate(next_ids.tolist()):
                if done[i]:
                    continue
                if token in ends:
                    out[i].finish, done[i] = "eos", True
                    continue
                out[i].tokens.append(token)
                if stops[i] is not None and stops[i](out[i].tokens):
                    out[i].finish, done[i] = "stop", True
                elif len(out[i].tokens) >= budgets[i]:
                    done[i] = True  # finish stays "length"
            if on_step is not None:
                on_step(out, done)
            if all(done):
                break
            tokens = next_ids[:, None]
        total = time.perf_counter() - begin
        stats = GenerationStats(len(prompts), sum(len(c.tokens) for c in out),
                                first if first is not None else total, total)
        return out, stats

    @staticmethod
    def _sequence(start: int, s: int, pads: torch.Tensor) -> Sequence:
        """Positions counted from each sequence's first real token (padding at 0)."""
        index = torch.arange(start, start + s, device=pads.device)
        return Sequence((index[None] - pads[:, None]).clamp(min=0), index, None)

    def _step(self, tokens: torch.Tensor, cache: KVCache, sequence: Sequence | None,
              sampling: Sampling, gen: torch.Generator) -> torch.Tensor:
        """One forward of the whole replica over ``tokens`` [b, s]; the next token of every
        sequence, on every rank."""
        b, s = tokens.shape
        pp = self.mesh.pp
        x = tokens
        if not self.first:
            x = torch.empty((b, s, self.model.cfg.hidden_size), dtype=self.dtype,
                            device=self.device)
            dist.recv(x, src=pp.ranks[pp.rank - 1])
        y = self.model(x, cache, sequence=sequence)
        if not self.last:
            dist.send(y.contiguous(), dst=pp.ranks[pp.rank + 1])
            cache.length += s  # the model counts cached tokens on the last stage only
        next_ids = torch.zeros(b, dtype=torch.long, device=self.device)
        if self.last:
            logits = all_gather(y[:, -1], self.mesh.tp, dim=1)[:, : self.model.vocab_size]
            if self.mesh.global_rank == self.sampler:
                next_ids = sample(logits.float(), sampling, gen)
        if self.mesh.model.pg is not None:  # over the replica (replicas run alike)
            dist.broadcast(next_ids, src=self.sampler, group=self.mesh.model.pg)
        return next_ids


def generate(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int = 0,
) -> list[int]:
    """Continue one ``prompt`` on a one-process model by up to ``max_new_tokens`` tokens;
    stop early at ``eos_id``."""
    sampling = Sampling(temperature, top_k, top_p, seed)
    completions, _ = Generator(model).generate([prompt], max_new_tokens, sampling, eos_id)
    return completions[0].tokens
