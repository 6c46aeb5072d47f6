"""Demonstrations of the tabletop pick task by its scripted expert, written as episode datasets.

Each frame records the observation, the instruction and the expert's action for that state.
The executed action is the expert's plus Gaussian noise on the motion (DART, Laskey et al.
2017): the recorded labels stay the expert's, but the states cover the small detours an
imitating policy will make, and the labels show the way back, which is what keeps a cloned
policy on track in closed loop. Episode i is seeded from (seed, i), so a set is a function of
its arguments; the seeds are stored, and evaluation uses others.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from meshtron.data import cache
from meshtron.data.episodes import Episode, EpisodeDataset, EpisodeWriter, episode_seed
from meshtron.envs import DEFAULT_ENV, ENV_NAME, WORDS, TabletopEnv, check_env_name, expert_action
from meshtron.envs.metaworld_tasks import dataset_env_id
from meshtron.errors import MeshtronError

__all__ = ["default_demonstrations", "episode_seed", "expert_episode",
           "generate_demonstrations"]

DEMO_VERSION = 1
"""Part of the cache key: bump when what is recorded changes."""
MOTION_NOISE = 0.3
"""Standard deviation of the noise added to the executed (dx, dy), in action units."""
_NOISE_STREAM = 0x5EED


def expert_episode(env: TabletopEnv, seed: int, noise: float,
                   rng: np.random.Generator) -> Episode:
    """One noisy-executed expert episode from ``env.reset(seed=seed)``."""
    obs, info = env.reset(seed=seed)
    images, actions = [], []
    done = False
    while not done:
        action = expert_action(env.state)
        images.append(obs["image"])
        actions.append(action)
        executed = action.copy()
        if noise > 0 and action[2] <= 0:  # the closing step is executed as the expert says
            executed[:2] = np.clip(executed[:2] + rng.normal(0.0, noise, 2), -1.0, 1.0)
        obs, _, terminated, truncated, info = env.step(executed)
        done = terminated or truncated
    return Episode(np.stack(images), np.stack(actions), env.state.instruction, seed,
                   bool(info["success"]))


def generate_demonstrations(episodes: int, seed: int, image_size: int, output: str | Path,
                            log: Callable[[str], object] = print, *,
                            noise: float = MOTION_NOISE, num_blocks: int = 4,
                            env: str = DEFAULT_ENV, workers: int | None = None) -> Path:
    """Write ``episodes`` successful expert episodes of environment ``env`` to the dataset
    ``output``; returns it.

    Failed episodes (rare: the noise can run one out of time) are skipped and the next seed
    index is tried, so the set always holds exactly ``episodes`` episodes. Meta-World's
    (``metaworld-mt10``, ``metaworld:<task>``) run in ``workers`` processes
    (:mod:`.metaworld_demonstrations`, its own noise); the tabletop task's in this one.
    """
    if episodes < 1 or seed < 0 or noise < 0:
        raise MeshtronError(f"demonstrations need episodes >= 1, seed >= 0 and noise >= 0, got "
                            f"{episodes}, {seed} and {noise}")
    if env != DEFAULT_ENV:
        check_env_name(env)
        from meshtron.data.metaworld_demonstrations import generate_metaworld

        return generate_metaworld(env, episodes, seed, image_size, output, log, workers=workers)
    env = TabletopEnv(image_size=image_size, num_blocks=num_blocks)
    start, kept, frames, index = time.perf_counter(), 0, 0, 0
    with EpisodeWriter(output, env=ENV_NAME, words=WORDS) as writer:
        while kept < episodes:
            if index >= 2 * episodes + 100:
                raise MeshtronError(f"the expert failed {index - kept} of {index} episodes; "
                                    "lower the noise")
            rng = np.random.default_rng([_NOISE_STREAM, seed, index])
            episode = expert_episode(env, episode_seed(seed, index), noise, rng)
            index += 1
            if episode.success:
                writer.add(episode)
                kept, frames = kept + 1, frames + len(episode)
        path = writer.close()
    seconds = time.perf_counter() - start
    log(f"vla-data: {kept} expert episodes ({frames} frames, {index - kept} failed and "
        f"skipped) in {seconds:.1f} s, {kept / max(seconds, 1e-9):.0f} episodes/s -> {path}")
    return path


def default_demonstrations(cache_dir: str | Path, episodes: int, seed: int, image_size: int,
                           log: Callable[[str], object] = print,
                           env: str = DEFAULT_ENV, states: bool = False) -> Path:
    """The path of the cached demonstration set for these arguments, generated on first use
    at ``<cache_dir>/demonstrations/<key>/episodes``; with ``states``, a Meta-World set cached
    before states were recorded gets them by replay (:mod:`.metaworld_states`, minutes
    instead of the set's regeneration)."""
    parts = [] if env == DEFAULT_ENV else [env, dataset_env_id(env)]
    key = cache.content_key("demonstrations", str(DEMO_VERSION), ENV_NAME, str(episodes),
                            str(seed), str(image_size), str(MOTION_NOISE), *parts)
    entry = cache.entry_dir(cache_dir, "demonstrations", key)
    path = entry / "episodes"
    with cache.locked(entry):
        try:
            dataset = EpisodeDataset.open(path)
        except MeshtronError:
            return generate_demonstrations(episodes, seed, image_size, path, log, env=env)
        if states and not dataset.state_dims and env != DEFAULT_ENV:
            from meshtron.data.metaworld_states import add_states

            log(f"vla-data: the cached set at {path} predates recorded states; replaying it")
            return add_states(path, env, seed, log)
    log(f"vla-data: cached {len(dataset)} expert episodes at {path}")
    return path
