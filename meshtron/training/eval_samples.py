"""Greedy samples at each evaluation (``train.eval_generate``), so a user sees the model learn.

The prompts are the first :data:`PROMPT_TOKENS` tokens of the first :data:`PROMPTS` sequences of
the validation split (the same every evaluation and on every rank); each continues greedily
on the training model itself (this rank's part of its replica, through the generation engine),
in eval mode, which is restored after. Greedy decoding draws no random numbers and MoE layers
keep no routing statistics in eval mode, so the training numbers are unchanged.
"""

from __future__ import annotations

import torch

from meshtron.data.tokenizer import Tokenizer
from meshtron.models.generation import GREEDY, Generator
from meshtron.models.transformer import Transformer
from meshtron.parallel.mesh.groups import ParallelMesh

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
