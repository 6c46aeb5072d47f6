"""A vision-language-action policy acting: one observation in, its action tokens out.

The prefix (the image's patch placeholders, the instruction and the readout token's
placeholder) runs once through the model with its KV cache, then the action tokens are
decoded greedily one by one, each restricted to the action bins (OpenVLA decodes the same
way). Several observations (environments stepping in lockstep) form one batch.
"""

from __future__ import annotations

import torch

from meshtron.config.kinds import STATE, VISION
from meshtron.errors import MeshtronError
from meshtron.models.input_encoder import ModelInputs
from meshtron.models.transformer import Transformer


class PolicyRunner:
    """Greedy action tokens of a :class:`Transformer` built with ``model.vision``."""

    def __init__(self, model: Transformer, first_action_id: int):
        self.model = model
        self.vision = model.cfg.vision
        self.first = first_action_id

    def _action_token(self, logits: torch.Tensor) -> torch.Tensor:
        bins = logits[:, self.first:self.first + self.vision.action_bins]
        return bins.argmax(dim=-1) + self.first

    @torch.no_grad()
    def act(self, images: torch.Tensor, instructions: torch.Tensor,
            states: torch.Tensor | None = None) -> torch.Tensor:
        """Action token ids [b, action_chunk x action_dims] for uint8 images [b, H, W, C],
        padded instruction ids [b, instruction_len] and, for a policy that reads it, the
        proprioceptive states float [b, state_dims]."""
        batch = images.shape[0]
        v = self.vision
        prefix = torch.cat([torch.zeros(batch, v.num_patches, dtype=torch.long),
                            instructions.long().cpu(),
                            torch.zeros(batch, v.readout_tokens + v.state_tokens,
                                        dtype=torch.long)],
                           dim=1).to(images.device)
        inputs = {VISION: images}
        if v.state_tokens:
            if states is None:
                raise MeshtronError("the policy reads the proprioceptive state; pass states")
            inputs[STATE] = states.to(images.device)
        cache = self.model.new_cache(batch, prefix.shape[1] + self.vision.action_tokens)
        logits = self.model(prefix, cache=cache, inputs=inputs)[:, -1]
        tokens = [self._action_token(logits.float())]
        for _ in range(self.vision.action_tokens - 1):
            logits = self.model(tokens[-1][:, None], cache=cache)[:, -1]
            tokens.append(self._action_token(logits.float()))
        return torch.stack(tokens, dim=1)

    @torch.no_grad()
    def token_accuracy(self, tokens: torch.Tensor, targets: torch.Tensor,
                       inputs: ModelInputs) -> tuple[int, int]:
        """(correct, counted) action tokens of teacher-forced observation windows (with their
        ``inputs``, the images): the greedy action token at each position whose target is an
        action."""
        logits = self.model(tokens, inputs=inputs)
        keep = targets >= 0
        predicted = self._action_token(logits[keep].float())
        return int((predicted == targets[keep]).sum()), int(keep.sum())
