"""The proprioceptive state encoder of a vision-language-action policy.

A robot policy that sees only the camera must find its own hand in the frame before it can
move it; the robot knows where its hand is. SmolVLA and LeRobot's policies therefore feed the
robot's state (here Meta-World's hand x, y, z and gripper opening) beside the image and the
instruction: a small MLP projects it into one token of the decoder's width, placed right
before the actions (``model.vision.state_token_positions``), and an RMSNorm starts that
token at the residual stream's scale (as the keypoint readout's, which the decoder otherwise
did not read). Small, so replicated over tp like the readout token; its input is the state
itself, not token ids, so sequence parallelism places it as any encoder's
(:func:`~meshtron.models.input_encoder.place_encoded`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.config import VisionConfig
from meshtron.errors import MeshtronError
from meshtron.models.input_encoder import InputEncoder
from meshtron.parallel.tensor.layers import TPRegion, replicated


class StateEncoder(InputEncoder):
    """float states [b, state_dims] -> one token [b, 1, decoder hidden]. Parameters, as the
    decoder's submodule ``state``: ``fc1.{weight,bias}``, ``fc2.{weight,bias}``,
    ``out_norm.weight``."""

    def __init__(self, vision: VisionConfig, decoder_hidden: int, region: TPRegion):
        super().__init__()
        # never sequence-parallel: every tp rank encodes the whole batch's states and the
        # placement's backward gathers the token's gradient, so the parameters' gradients are
        # whole on each rank already (an SP region would sum them over tp a second time)
        region = TPRegion(region.group)
        self.vision = vision
        self.fc1 = nn.Linear(vision.state_dims, decoder_hidden)
        self.fc2 = nn.Linear(decoder_hidden, decoder_hidden)
        self.out_norm = nn.RMSNorm(decoder_hidden, eps=vision.norm_eps)
        for param in self.parameters():
            replicated(param, region)

    def positions(self) -> list[int]:
        return self.vision.state_token_positions

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        dims = self.vision.state_dims
        if not states.is_floating_point() or states.dim() != 2 or states.shape[1] != dims:
            raise MeshtronError(f"proprioceptive states must be float [batch, {dims}], got "
                                f"{states.dtype} {list(states.shape)}")
        x = states.to(self.fc1.weight.dtype)
        return self.out_norm(self.fc2(F.gelu(self.fc1(x))))[:, None]

    def encode_input(self, value: torch.Tensor, tokens: torch.Tensor,
                     start: int) -> torch.Tensor:
        return self(value)


def state_parameters(vision: VisionConfig, decoder_hidden: int) -> int:
    """Parameters of the state encoder (0 without a state)."""
    if not vision.state_tokens:
        return 0
    d = decoder_hidden
    return vision.state_dims * d + d + d * d + d + d
