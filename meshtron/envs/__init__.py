"""Simulated robot tasks for vision-language-action policies, made by name (``make_env``): the
tabletop pick task, its scripted expert, and GIFs of rollouts; Meta-World by name
(``metaworld-mt10``, ``metaworld:<task>``, MuJoCo imported only then). Imports only numpy,
gymnasium, Pillow and errors (and metaworld/mujoco lazily)."""

from meshtron.envs.expert import CLOSE_TOLERANCE, expert_action
from meshtron.envs.registry import (
    DEFAULT_ENV,
    ENVIRONMENTS,
    EnvSpec,
    check_env_name,
    env_spec,
    make_env,
)
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
    "EnvSpec",
    "WORDS",
    "Block",
    "Rollout",
    "TabletopEnv",
    "TabletopState",
    "check_env_name",
    "env_spec",
    "expert_action",
    "make_env",
    "render_state",
    "rollout",
    "save_gif",
]
