"""Environments by name: every task a policy is trained or evaluated on is a Gymnasium
environment (``reset``/``step``, an observation dict with the camera ``image`` and the
``instruction``, ``info["success"]``) made from its name, so that demonstrations and closed-loop
evaluation take an environment name instead of a class. ``tabletop`` is the fast task this
package ships; another benchmark is one more entry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym

from meshtron.envs.tabletop import TabletopEnv
from meshtron.errors import MeshtronError

ENVIRONMENTS: dict[str, Callable[..., gym.Env]] = {"tabletop": TabletopEnv}
"""Each environment's constructor by name (its keyword options, such as ``image_size``)."""

DEFAULT_ENV = "tabletop"


def make_env(name: str = DEFAULT_ENV, **options: Any) -> gym.Env:
    """A new environment ``name`` built with ``options``; an unknown name is one line that
    lists the known ones."""
    factory = ENVIRONMENTS.get(name)
    if factory is None:
        raise MeshtronError(f"unknown environment {name!r}; the environments are "
                            f"{', '.join(sorted(ENVIRONMENTS))}")
    return factory(**options)
