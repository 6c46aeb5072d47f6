"""The proprioceptive state of Meta-World demonstrations written before states were recorded,
recovered by replaying each episode without rendering.

An episode of a set generated with ``seed`` is attempt ``a`` of task ``t``; its environment
seed is ``episode_seed(seed, a * T + t)`` and the noise on its executed motion comes from
``(stream, seed, t, a)`` (:mod:`.metaworld_demonstrations`). Both are functions of the stored
seed, so resetting the scene, re-running the expert and executing its action plus the same
noise retraces the episode step for step: the expert's action at every replayed step must equal
the recorded one (checked, so a replay that drifts is refused instead of writing wrong states).
Rendering is most of an episode's cost, so the replay draws no frames: the 300-episode MT10 set
takes a few CPU-minutes instead of the half hour its generation took.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from meshtron.data.episodes import Episode, EpisodeDataset, EpisodeWriter
from meshtron.data.metaworld_demonstrations import _NOISE_STREAM, MOTION_NOISE, _seed_of
from meshtron.errors import MeshtronError

MAX_ATTEMPTS = 4096
"""Attempt indices searched for an episode's seed (generation stops far below)."""


def attempts_of(seeds: list[int], set_seed: int, tasks: int) -> list[tuple[int, int]]:
    """(task index, attempt) of each environment seed of a set generated with ``set_seed``."""
    wanted, found = set(seeds), {}
    for attempt in range(MAX_ATTEMPTS):
        for t in range(tasks):
            s = _seed_of(set_seed, attempt, t, tasks)
            if s in wanted:
                found.setdefault(s, (t, attempt))
        if len(found) == len(wanted):
            break
    missing = sorted(wanted - set(found))
    if missing:
        raise MeshtronError(f"episode seed {missing[0]} is not one of a set generated with seed "
                            f"{set_seed}; its states cannot be replayed")
    return [found[s] for s in seeds]


def replay_states(env, task: str, seed: int, noise: float, rng: np.random.Generator,
                  actions: np.ndarray) -> np.ndarray:
    """The states [T, D] of the recorded episode with expert ``actions`` [T, A] of ``task``
    from scene ``seed``, replayed with its noise ``rng``."""
    obs, _ = env.reset(seed=seed, options={"task": task})
    states = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the experts' "constants may be too high"
        for step, recorded in enumerate(actions):
            action = env.expert_action()
            if not np.array_equal(action, recorded):
                raise MeshtronError(f"replaying {task} from seed {seed} departs from the "
                                    f"recording at step {step}; its states cannot be recovered")
            states.append(obs["state"])
            executed = action.copy()
            if noise > 0:
                executed[:3] = np.clip(executed[:3] + rng.normal(0.0, noise, 3), -1.0, 1.0)
            obs, *_ = env.step(executed)
    return np.stack(states).astype(np.float32)


def add_states(path: str | Path, name: str, set_seed: int,
               log: Callable[[str], object] = print, *, noise: float = MOTION_NOISE) -> Path:
    """Rewrite the Meta-World dataset at ``path`` (of environment ``name``, generated with
    ``set_seed``) with each frame's proprioceptive state; a set that has them is left as is."""
    from meshtron.envs.metaworld import MetaWorldEnv

    dataset = EpisodeDataset.open(path)
    if dataset.state_dims:
        return Path(path)
    start = time.perf_counter()
    env = MetaWorldEnv(name, image_size=dataset.image_size, images=False)
    tasks = env.tasks
    try:
        places = attempts_of([int(s) for s in dataset.seeds], set_seed, len(tasks))
        episodes = []
        for i, (t, attempt) in enumerate(places):
            episode = dataset[i]
            rng = np.random.default_rng([_NOISE_STREAM, set_seed, t, attempt])
            states = replay_states(env, tasks[t], int(episode.seed), noise, rng, episode.actions)
            episodes.append(Episode(episode.images, episode.actions, episode.instruction,
                                    episode.seed, episode.success, states))
    finally:
        env.close()
    with EpisodeWriter(path, env=dataset.env, words=dataset.words) as writer:
        for episode in episodes:
            writer.add(episode)
        writer.close()
    log(f"vla-data: added the proprioceptive state to {len(episodes)} episodes of {path} by "
        f"replaying them without rendering in {time.perf_counter() - start:.0f} s")
    return Path(path)
