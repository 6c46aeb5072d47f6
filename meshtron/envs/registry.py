"""Environments by name: every task a policy is trained or evaluated on is a Gymnasium
environment (``reset``/``step``, an observation dict with the camera ``image`` and the
``instruction``, ``info["success"]``, ``outcome()`` once it ends) made from its name, so that
demonstrations and closed-loop evaluation take an environment name instead of a class.
``tabletop`` is the fast task this package ships; ``metaworld-mt10`` and ``metaworld:<task>``
are Meta-World's (:mod:`.metaworld`, MuJoCo imported only when one is made).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from meshtron.envs import metaworld_tasks
from meshtron.envs.tabletop import ENV_NAME, WORDS, TabletopEnv
from meshtron.errors import MeshtronError

ENVIRONMENTS: dict[str, Callable[..., gym.Env]] = {"tabletop": TabletopEnv}
"""Each built-in environment's constructor by name (its keyword options, such as
``image_size``); Meta-World's names are matched apart (one per task)."""

DEFAULT_ENV = "tabletop"


@dataclass(frozen=True)
class EnvSpec:
    """What a policy must agree with before any simulation starts."""

    name: str
    action_dims: int
    dataset_env: str
    """The ``env`` its demonstration datasets record."""
    words: tuple[str, ...]
    """The instruction vocabulary."""
    tasks: tuple[str, ...]
    """Its tasks (evaluation reports each); one for the tabletop task."""
    state_dims: int = 0
    """Entries of the proprioceptive ``state`` its observations carry (0: none)."""


def env_names() -> str:
    """The known names, for messages."""
    return ", ".join([*sorted(ENVIRONMENTS), metaworld_tasks.MT10_ENV,
                      metaworld_tasks.TASK_PREFIX + "<task>"])


def env_spec(name: str) -> EnvSpec:
    """The spec of environment ``name``; an unknown name or task is one line."""
    if name in ENVIRONMENTS:
        return EnvSpec(name, 3, ENV_NAME, WORDS, (name,))
    if name == metaworld_tasks.MT10_ENV or name.startswith(metaworld_tasks.TASK_PREFIX):
        return EnvSpec(name, 4, metaworld_tasks.dataset_env_id(name),
                       metaworld_tasks.vocabulary(), metaworld_tasks.tasks_of(name),
                       metaworld_tasks.STATE_DIMS)
    raise MeshtronError(f"unknown environment {name!r}; the environments are {env_names()}")


def check_env_name(name: str) -> None:
    """One line when ``name`` is not an environment (or not a known task)."""
    env_spec(name)


def make_env(name: str = DEFAULT_ENV, **options: Any) -> gym.Env:
    """A new environment ``name`` built with ``options``; an unknown name is one line that
    lists the known ones."""
    env_spec(name)
    factory = ENVIRONMENTS.get(name)
    if factory is not None:
        return factory(**options)
    from meshtron.envs.metaworld import MetaWorldEnv

    return MetaWorldEnv(name, **options)
