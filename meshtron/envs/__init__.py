"""Simulated robot tasks for vision-language-action policies, made by name (``make_env``): the
tabletop pick task, its scripted expert, and GIFs of rollouts. Imports only numpy, gymnasium,
Pillow and errors."""

from meshtron.envs.expert import CLOSE_TOLERANCE, expert_action
from meshtron.envs.registry import DEFAULT_ENV, ENVIRONMENTS, make_env
from meshtron.envs.tabletop import (
    COLOUR_NAMES,
    ENV_NAME,
    WORDS,
    Block,
    Rollout,
    TabletopEnv,
    TabletopState,
    render_state,
    rollout,
)
from meshtron.envs.video import save_gif

__all__ = [
    "CLOSE_TOLERANCE",
    "COLOUR_NAMES",
    "DEFAULT_ENV",
    "ENVIRONMENTS",
    "ENV_NAME",
    "WORDS",
    "Block",
    "Rollout",
    "TabletopEnv",
    "TabletopState",
    "expert_action",
    "make_env",
    "render_state",
    "rollout",
    "save_gif",
]
