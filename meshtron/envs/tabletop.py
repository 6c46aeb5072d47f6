"""A table seen from above, coloured blocks on it, and an instruction naming the one to pick.

The task is the smallest one a vision-language-action policy genuinely needs both inputs for:
the instruction says *which* colour, only the image says *where* that block (and the gripper)
is, and the colours and places are drawn anew for every seed. Everything else is kept easy to
imitate from a 32x32 image: flat saturated squares on a dark table, a white gripper outline,
short episodes, and an expert whose action is a function of what is visible now (see
:mod:`meshtron.envs.expert`), so a stateless policy can copy it and closed loop corrects small
errors.

Coordinates are table units in [0, 1]: x to the right, y downwards (image rows). An action is
(dx, dy, grip) in [-1, 1]; the gripper moves by ``(dx, dy) * MAX_STEP`` (clamped to the table)
and then, when ``grip > 0``, closes. Closing ends the episode: it succeeds when the gripper's
centre is over the named block, and fails over another block or over bare table. An episode
that has not closed after ``max_steps`` steps is truncated (a failure).
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from meshtron.errors import MeshtronError

ENV_NAME = "meshtron/TabletopPick-v1"
"""Recorded in demonstration datasets; bumped whenever the task's dynamics or images change."""

COLOURS: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("red", (230, 40, 40)),
    ("green", (40, 200, 60)),
    ("blue", (50, 90, 245)),
    ("yellow", (240, 220, 30)),
    ("purple", (170, 60, 230)),
    ("cyan", (30, 215, 215)),
)
"""Block colours: saturated, far apart in RGB, all far from the table and the gripper."""
COLOUR_NAMES = tuple(name for name, _ in COLOURS)
TABLE_RGB = (55, 55, 60)
GRIPPER_RGB = (255, 255, 255)

VERBS = ("pick up", "grab", "lift")
NOUNS = ("block", "cube")
WORDS: tuple[str, ...] = ("pick", "up", "grab", "lift", "the", *COLOUR_NAMES, "block", "cube")
"""Every word an instruction can contain: ``"<verb> the <colour> <noun>"``, 3 to 5 words."""
MAX_INSTRUCTION_CHARS = 32

BLOCK_HALF = 0.07
"""Half the side of a block; also the success tolerance (the gripper's centre over the block)."""
GRIPPER_HALF, GRIPPER_CLOSED_HALF, GRIPPER_LINE = 0.12, 0.085, 0.035
MAX_STEP = 0.1
"""How far the gripper moves per step along each axis at |action| = 1."""
PLACE_LOW, PLACE_HIGH = 0.1, 0.9
MIN_SEPARATION = 0.24
"""Blocks' centres are at least this far apart along x or y: a gripper outline centred on one
block never covers another."""


@dataclasses.dataclass(frozen=True)
class Block:
    colour: str
    x: float
    y: float


@dataclasses.dataclass(frozen=True)
class TabletopState:
    """Everything about an episode: what is drawn, what was asked, how far it has gone."""

    gripper: tuple[float, float]
    blocks: tuple[Block, ...]
    target: int
    """Index into ``blocks`` of the block the instruction names."""
    instruction: str
    steps: int = 0
    closed: bool = False
    success: bool = False

    @property
    def target_block(self) -> Block:
        return self.blocks[self.target]


def instruction_for(colour: str, verb: str = VERBS[0], noun: str = NOUNS[0]) -> str:
    return f"{verb} the {colour} {noun}"


def block_under(state: TabletopState, x: float, y: float) -> int | None:
    """The index of the block whose square contains (x, y), or None over bare table."""
    for i, block in enumerate(state.blocks):
        if abs(x - block.x) <= BLOCK_HALF and abs(y - block.y) <= BLOCK_HALF:
            return i
    return None


def outcome_of(state: TabletopState) -> str:
    """How an episode ending in ``state`` ended (:attr:`TabletopEnv.OUTCOMES`): a success,
    never closed (timeout), or closed over bare table or over another block."""
    if state.success:
        return "success"
    if not state.closed:
        return "timeout"
    return "table" if block_under(state, *state.gripper) is None else "other_block"


def _coverage(low: np.ndarray, high: np.ndarray, size: int) -> np.ndarray:
    """[k, size]: the fraction of each pixel along one axis that each interval [low, high]
    (table units) covers; boxes are drawn antialiased so sub-pixel positions stay visible."""
    edges = np.arange(size, dtype=np.float32)
    covered = (np.minimum(high[:, None] * size, edges + 1)
               - np.maximum(low[:, None] * size, edges))
    return np.minimum(np.maximum(covered, 0.0), 1.0)


def _box_alphas(centres: np.ndarray, halves: np.ndarray, size: int) -> np.ndarray:
    """[k, size, size]: the coverage of each axis-aligned square (centre [k, 2], half side
    [k]) over each pixel."""
    k = len(centres)
    cover = _coverage((centres.T - halves).ravel(), (centres.T + halves).ravel(), size)
    return cover[k:, :, None] * cover[:k, None, :]


def render_state(state: TabletopState, size: int) -> np.ndarray:
    """The top-down view of ``state`` as a uint8 [size, size, 3] image (numpy only).

    Blocks never share a pixel (MIN_SEPARATION), so they are composited in one sum; the
    gripper's outline (outer square minus inner square) is drawn over them.
    """
    rgb = dict(COLOURS)
    centres = np.array([(b.x, b.y) for b in state.blocks], dtype=np.float32)
    colours = np.array([rgb[b.colour] for b in state.blocks], dtype=np.float32)
    alpha = _box_alphas(centres, np.full(len(centres), BLOCK_HALF, np.float32), size)
    table = np.asarray(TABLE_RGB, np.float32)
    canvas = table + np.einsum("kij,kc->ijc", alpha, colours - table)
    half = GRIPPER_CLOSED_HALF if state.closed else GRIPPER_HALF
    rings = _box_alphas(np.array([state.gripper] * 2, np.float32),
                        np.array([half, half - GRIPPER_LINE], np.float32), size)
    ring = (rings[0] - rings[1])[..., None]
    canvas += ring * (np.asarray(GRIPPER_RGB, np.float32) - canvas)
    return np.rint(canvas).astype(np.uint8)


class TabletopEnv(gym.Env):
    """Pick the named block: ``obs = {"image": uint8 [H, W, 3], "instruction": str}``.

    ``reward`` is 1.0 on the step that closes the gripper over the named block, else 0.0;
    ``info["success"]`` says whether the episode has succeeded. The same seed gives the same
    scene, instruction, images and outcomes.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 4}
    OUTCOMES = ("success", "other_block", "table", "timeout")
    """How an episode ends: closed over the named block, over another block, over bare table,
    or not closed within the step limit."""

    def __init__(self, image_size: int = 32, num_blocks: int = 4, max_steps: int = 25,
                 render_mode: str | None = None) -> None:
        if not isinstance(image_size, int) or not 16 <= image_size <= 512:
            raise MeshtronError(f"image_size must be an integer from 16 to 512, not {image_size}")
        if not isinstance(num_blocks, int) or not 1 <= num_blocks <= len(COLOURS):
            raise MeshtronError(f"num_blocks must be from 1 to {len(COLOURS)}, not {num_blocks}")
        if not isinstance(max_steps, int) or max_steps < 1:
            raise MeshtronError(f"max_steps must be a positive integer, not {max_steps}")
        if render_mode not in (None, "rgb_array"):
            raise MeshtronError(f"render_mode must be None or 'rgb_array', not {render_mode!r}")
        self.image_size, self.num_blocks, self.max_steps = image_size, num_blocks, max_steps
        self.render_mode = render_mode
        self.observation_space = spaces.Dict({
            "image": spaces.Box(0, 255, (image_size, image_size, 3), np.uint8),
            "instruction": spaces.Text(MAX_INSTRUCTION_CHARS,
                                       charset=string.ascii_lowercase + " "),
        })
        self.action_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
        self._state: TabletopState | None = None
        self._done = False

    @property
    def state(self) -> TabletopState:
        """The current state (immutable): what the scripted expert acts on."""
        if self._state is None:
            raise MeshtronError("the environment has no episode yet; call reset() first")
        return self._state

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        if options:
            raise MeshtronError(f"TabletopEnv.reset takes no options, got {sorted(options)}")
        rng = self.np_random
        colours = rng.choice(len(COLOURS), size=self.num_blocks, replace=False)
        places = _separated_points(rng, self.num_blocks)
        blocks = tuple(Block(COLOUR_NAMES[int(c)], float(x), float(y))
                       for c, (x, y) in zip(colours, places))
        target = int(rng.integers(self.num_blocks))
        verb, noun = VERBS[int(rng.integers(len(VERBS)))], NOUNS[int(rng.integers(len(NOUNS)))]
        gripper = rng.uniform(PLACE_LOW, PLACE_HIGH, size=2)
        self._state = TabletopState(
            gripper=(float(gripper[0]), float(gripper[1])), blocks=blocks, target=target,
            instruction=instruction_for(blocks[target].colour, verb, noun))
        self._done = False
        return self._observation(), self._info()

    def step(self, action: Any) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        state = self.state
        if self._done:
            raise MeshtronError("step() after the episode ended; call reset() first")
        try:
            act = np.asarray(action, dtype=np.float64)
        except (TypeError, ValueError):
            act = np.full(1, np.nan)
        if act.shape != (3,) or not np.all(np.isfinite(act)):
            raise MeshtronError(f"an action is 3 finite numbers (dx, dy, grip), got {action!r}")
        act = np.clip(act, -1.0, 1.0)
        x = float(np.clip(state.gripper[0] + act[0] * MAX_STEP, 0.0, 1.0))
        y = float(np.clip(state.gripper[1] + act[1] * MAX_STEP, 0.0, 1.0))
        closed = bool(act[2] > 0)
        success = closed and block_under(state, x, y) == state.target
        self._state = dataclasses.replace(state, gripper=(x, y), steps=state.steps + 1,
                                          closed=closed, success=success)
        truncated = not closed and self._state.steps >= self.max_steps
        self._done = closed or truncated
        return self._observation(), float(success), closed, truncated, self._info()

    def outcome(self) -> str:
        """How the episode ended so far (:attr:`OUTCOMES`)."""
        return outcome_of(self.state)

    def render(self) -> np.ndarray | None:
        if self.render_mode != "rgb_array":
            return None
        return render_state(self.state, self.image_size)

    def _observation(self) -> dict[str, Any]:
        state = self.state
        return {"image": render_state(state, self.image_size), "instruction": state.instruction}

    def _info(self) -> dict[str, Any]:
        state = self.state
        return {"success": state.success, "steps": state.steps,
                "target": state.target_block.colour}


def _separated_points(rng: np.random.Generator, count: int) -> np.ndarray:
    """``count`` uniform points in [PLACE_LOW, PLACE_HIGH]^2, pairwise MIN_SEPARATION apart
    along x or y (rejection sampling; six points fit with ease)."""
    for _ in range(10_000):
        points = rng.uniform(PLACE_LOW, PLACE_HIGH, size=(count, 2))
        gaps = np.abs(points[:, None, :] - points[None, :, :]).max(axis=-1)
        np.fill_diagonal(gaps, np.inf)
        if gaps.min() >= MIN_SEPARATION:
            return points
    raise MeshtronError(f"cannot place {count} separated blocks on the table")


Policy = Callable[[dict[str, Any], TabletopState], Any]
"""A policy for :func:`rollout`: (observation, state) -> action. Learned policies should read
only the observation; scripted ones (the expert, baselines) read the state."""


@dataclasses.dataclass(frozen=True)
class Rollout:
    images: np.ndarray
    """uint8 [T + 1, H, W, 3]: every observation, the last one after the final action."""
    actions: np.ndarray
    """float32 [T, 3]: the action taken at each of the T steps."""
    instruction: str
    seed: int | None
    success: bool


def rollout(env: TabletopEnv, policy: Policy, seed: int | None = None) -> Rollout:
    """Run one episode of ``policy`` from ``env.reset(seed=seed)`` to its end."""
    obs, info = env.reset(seed=seed)
    images, actions = [obs["image"]], []
    done = False
    while not done:
        action = np.asarray(policy(obs, env.state), dtype=np.float32)
        obs, _, terminated, truncated, info = env.step(action)
        images.append(obs["image"])
        actions.append(action)
        done = terminated or truncated
    return Rollout(np.stack(images), np.stack(actions).astype(np.float32),
                   env.state.instruction, seed, bool(info["success"]))
