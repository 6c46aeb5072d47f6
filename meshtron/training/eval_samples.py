"""Greedy samples at each evaluation (``train.eval_generate``), so a user sees the model learn.

The prompts are the first :data:`PROMPT_TOKENS` tokens of the first :data:`PROMPTS` sequences of
the validation split (the same every evaluation and on every rank); each continues greedily
on the training model itself (this rank's part of its replica, through the generation engine),
in eval mode, which is restored after. Greedy decoding draws no random numbers and MoE layers
keep no routing statistics in eval mode, so the training numbers are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshtron.data.tokenizer import Tokenizer
from meshtron.models.generation import GREEDY, Generator
from meshtron.models.transformer import Transformer
from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.training.metrics import MetricsWriter
from meshtron.training.observers import Observer, StepReport

PROMPT_TOKENS = 16
PROMPTS = 2


def eval_samples(model: Transformer, mesh: ParallelMesh, valid_batch: torch.Tensor,
                 new_tokens: int, tokenizer: Tokenizer) -> list[tuple[str, str]]:
    """(prompt, continuation) texts from the first rows of ``valid_batch`` (token windows)."""
    prompts = valid_batch[:PROMPTS, :PROMPT_TOKENS].tolist()
    was_training = model.training
    try:
        completions, _ = Generator(model, mesh).generate(prompts, new_tokens, GREEDY,
                                                         tokenizer.eos_id)
    finally:
        model.train(was_training)
    return [(tokenizer.decode(prompt), tokenizer.decode(done.tokens))
            for prompt, done in zip(prompts, completions)]


class EvalSamples(Observer):
    """At each evaluation, ``new_tokens`` greedy tokens after each prompt of ``valid_batch``,
    generated on every rank (the engine's collectives), logged once and written to
    TensorBoard."""

    def __init__(self, valid_batch: torch.Tensor, new_tokens: int, tokenizer: Tokenizer,
                 log: Callable[[str], None], writer: MetricsWriter | None):
        self.valid_batch, self.new_tokens, self.tokenizer = valid_batch, new_tokens, tokenizer
        self.log, self.writer = log, writer

    def on_eval(self, report: StepReport) -> None:
        samples = eval_samples(report.rank.model, report.rank.mesh, self.valid_batch,
                               self.new_tokens, self.tokenizer)
        for i, (prompt, text) in enumerate(samples):
            self.log(f"sample {i + 1} at step {report.step}: {prompt!r} -> {text!r}")
            if self.writer:
                self.writer.write_text(f"samples/{i + 1}", f"{prompt} ▸ {text}", report.step)
