"""The ``model.vision`` section: what turns the decoder into a vision-language-action policy."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from meshtron.errors import MeshtronError


@dataclass
class VisionConfig:
    """Vision-language-action models (``model.vision.*``): a ViT patch encoder and an MLP
    projector put image tokens before the instruction tokens of the decoder, which predicts
    actions as discretised tokens. ``image_size`` 0 (the default) is a text-only model. Unset
    fields (None) come from the preset, then from :data:`VISION_DEFAULTS`."""

    image_size: int | None = None
    """Side of the square RGB images in pixels; 0: no vision encoder (a text model)."""
    patch_size: int | None = None
    """Side of one square patch; image_size must be a multiple of it."""
    channels: int | None = None
    """Colour channels of the images."""
    hidden_size: int | None = None
    """Width of the vision encoder."""
    num_layers: int | None = None
    """Vision encoder blocks (bidirectional attention, GELU MLP)."""
    num_heads: int | None = None
    """Attention heads of the vision encoder."""
    ffn_hidden_size: int | None = None
    """Hidden units of the vision encoder's MLP."""
    norm_eps: float | None = None
    """Epsilon of the vision encoder's LayerNorms."""
    action_dims: int | None = None
    """Dimensions of one action (end-effector motion and gripper)."""
    action_bins: int | None = None
    """Tokens per action dimension: each dimension's range is cut into this many equal bins."""
    action_chunk: int | None = None
    """Future actions predicted per observation (action chunking); 1: the next action."""
    instruction_len: int | None = None
    """Instruction tokens per observation (shorter instructions are padded)."""
    action_low: list[float] | None = None
    """Lower end of each action dimension's range; None: taken from the dataset."""
    action_high: list[float] | None = None
    """Upper end of each action dimension's range; None: taken from the dataset."""
    keypoints: int | None = None
    """Spatial-softmax keypoints of the readout token (0: no readout token). The token sits
    right before the actions and carries where things are: per keypoint a softmax over the
    patches and its expected (x, y), through an MLP into the decoder's width. Without it the
    decoder did not learn to read positions off the patch tokens (docs/vla.md)."""
    instruction_keypoints: int | None = None
    """Keypoint maps of the readout token queried by the instruction's words, beside the
    ``keypoints`` fixed ones: they can point at the block the instruction names."""
    state_dims: int | None = None
    """Entries of the environment's proprioceptive state the policy reads (Meta-World: 4, the
    hand's x, y, z and the gripper's opening); 0: none. The state is projected into one token
    right before the actions (after the readout token), as SmolVLA and LeRobot's policies
    feed the robot's state beside the image and the instruction."""
    env: str | None = None
    """The environment the policy acts in (``tabletop``, ``metaworld-mt10``,
    ``metaworld:<task>``): its demonstrations are the default data and its action space must
    have ``action_dims`` dimensions (docs/vla.md)."""
    pretrained: str | None = None
    """A Hugging Face SigLIP vision folder (save_pretrained's) the encoder starts from, as
    OpenVLA starts from pretrained towers; its shape must match these fields. None: drawn
    from the seed like every other weight."""

    @property
    def enabled(self) -> bool:
        return bool(self.image_size)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2 if self.enabled else 0

    @property
    def action_tokens(self) -> int:
        """Action tokens predicted per observation: action_chunk x action_dims."""
        return self.action_chunk * self.action_dims if self.enabled else 0

    @property
    def readout_tokens(self) -> int:
        """Keypoint readout tokens per observation: 1 with (instruction) keypoints, else 0."""
        return 1 if self.enabled and (self.keypoints or self.instruction_keypoints) else 0

    @property
    def state_tokens(self) -> int:
        """Proprioceptive state tokens per observation: 1 when ``state_dims``, else 0."""
        return 1 if self.enabled and self.state_dims else 0

    @property
    def state_token_positions(self) -> list[int]:
        """Where the state token goes: after the readout token, right before the actions."""
        return [self.num_patches + self.instruction_len + self.readout_tokens] * self.state_tokens

    @property
    def image_token_positions(self) -> list[int]:
        """Where the encoder's tokens go in the window: the patches first (0 .. patches - 1),
        the readout token right after the instruction, before the actions."""
        readout = [self.num_patches + self.instruction_len] * self.readout_tokens
        return list(range(self.num_patches)) + readout

    @property
    def seq_len(self) -> int:
        """The decoder's input length per observation: image patches, instruction tokens, the
        readout token, the state token and the action tokens but the last (which is only
        predicted)."""
        return (self.num_patches + self.instruction_len + self.readout_tokens
                + self.state_tokens + self.action_tokens - 1)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """[H, W, C] of one camera image."""
        return (self.image_size, self.image_size, self.channels)


def check_vision(v: VisionConfig) -> None:
    """The vision section on its own (a text model's, image_size 0, is not looked at)."""
    if v.image_size < 0:
        raise MeshtronError(f"model.vision.image_size must not be negative, got {v.image_size}")
    if not v.enabled:
        return
    for name in ("patch_size", "channels", "hidden_size", "num_layers", "num_heads",
                 "ffn_hidden_size", "action_dims", "action_chunk", "instruction_len"):
        value = getattr(v, name)
        if value <= 0:
            raise MeshtronError(f"model.vision.{name} must be a positive integer, got {value}")
    if v.image_size % v.patch_size:
        raise MeshtronError(f"model.vision.image_size={v.image_size} is not divisible by "
                            f"model.vision.patch_size={v.patch_size}")
    if v.hidden_size % v.num_heads:
        raise MeshtronError(f"model.vision.hidden_size={v.hidden_size} is not divisible by "
                            f"model.vision.num_heads={v.num_heads}")
    for name in ("keypoints", "instruction_keypoints", "state_dims"):
        if getattr(v, name) < 0:
            raise MeshtronError(f"model.vision.{name} must not be negative, got "
                                f"{getattr(v, name)}")
    if v.action_bins < 2:
        raise MeshtronError(f"model.vision.action_bins must be at least 2, got {v.action_bins}")
    if not (math.isfinite(v.norm_eps) and v.norm_eps > 0):
        raise MeshtronError(f"model.vision.norm_eps must be a positive number, got {v.norm_eps}")
    from meshtron.envs import env_spec

    spec = env_spec(v.env)
    if spec.action_dims != v.action_dims:
        raise MeshtronError(f"model.vision.env={v.env} acts with {spec.action_dims}-dimensional "
                            f"actions, but model.vision.action_dims={v.action_dims}")
    if v.state_dims > spec.state_dims:
        raise MeshtronError(f"model.vision.env={v.env} observes a {spec.state_dims}-entry state, "
                            f"but model.vision.state_dims={v.state_dims}")
    ranges = (v.action_low, v.action_high)
    if (ranges[0] is None) != (ranges[1] is None):
        raise MeshtronError("model.vision.action_low and action_high are set together (or "
                            "both left unset to take the dataset's range)")
    if ranges[0] is not None:
        for name, values in zip(("action_low", "action_high"), ranges, strict=True):
            if len(values) != v.action_dims:
                raise MeshtronError(f"model.vision.{name} has {len(values)} values for "
                                    f"{v.action_dims} action dimensions")
        for d, (low, high) in enumerate(zip(*ranges, strict=True)):
            if not (math.isfinite(low) and math.isfinite(high) and low < high):
                raise MeshtronError(f"model.vision action dimension {d}: action_low={low} must "
                                    f"be below action_high={high}")


VISION_DEFAULTS: dict[str, Any] = dict(
    image_size=0, patch_size=8, channels=3, hidden_size=128, num_layers=2, num_heads=4,
    ffn_hidden_size=512, norm_eps=1e-6, action_dims=3, action_bins=256, action_chunk=1,
    instruction_len=11, keypoints=16, instruction_keypoints=4, state_dims=0, env="tabletop",
)
