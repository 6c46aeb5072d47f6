"""Meta-World demonstrations from each task's scripted expert, rolled out in parallel processes.

A set of N episodes over an environment's tasks gives task t of T the quota N // T (plus one
for the first N % T tasks). Attempt a of task t replays environment seed
``episode_seed(seed, a * T + t)``; the expert's actions are recorded and executed with a little
Gaussian noise on the motion (DART, as for the tabletop task), and only successful episodes are
kept: a task's episodes are its first ``quota`` successful attempts in attempt order. Attempts
run in chunks on a pool of spawned processes (each builds its own simulations and renderer),
so the set is the same whatever the number of processes or the order chunks finish in.
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from meshtron.data.episodes import Episode, EpisodeWriter, episode_seed
from meshtron.errors import MeshtronError

MOTION_NOISE = 0.1
"""Standard deviation of the noise on the executed (dx, dy, dz), in action units."""
CHUNK = 4
"""Attempts per job a worker process runs."""
_NOISE_STREAM = 0x3E7A


def _seed_of(seed: int, attempt: int, task_index: int, tasks: int) -> int:
    return episode_seed(seed, attempt * tasks + task_index)


def run_chunk(name: str, task_index: int, attempts: range, seed: int, image_size: int,
              noise: float) -> list[tuple[int, Episode | None]]:
    """Attempts ``attempts`` of task ``task_index`` of environment ``name``: (attempt, the
    episode, or None when the expert failed). Runs in a worker process."""
    from meshtron.envs.metaworld import MetaWorldEnv

    env = MetaWorldEnv(name, image_size=image_size)
    try:
        task = env.tasks[task_index]
        results = []
        for attempt in attempts:
            env_seed = _seed_of(seed, attempt, task_index, len(env.tasks))
            rng = np.random.default_rng([_NOISE_STREAM, seed, task_index, attempt])
            episode = expert_episode(env, task, env_seed, noise, rng)
            results.append((attempt, episode if episode.success else None))
        return results
    finally:
        env.close()


def expert_episode(env, task: str, seed: int, noise: float,
                   rng: np.random.Generator) -> Episode:
    """One noisy-executed expert episode of ``task`` from scene ``seed``."""
    obs, _ = env.reset(seed=seed, options={"task": task})
    images, states, actions, done, info = [], [], [], False, {"success": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the experts' "constants may be too high"
        while not done:
            action = env.expert_action()
            images.append(obs["image"])
            states.append(obs["state"])
            actions.append(action)
            executed = action.copy()
            if noise > 0:
                executed[:3] = np.clip(executed[:3] + rng.normal(0.0, noise, 3), -1.0, 1.0)
            obs, _, terminated, truncated, info = env.step(executed)
            done = terminated or truncated
    return Episode(np.stack(images), np.stack(actions).astype(np.float32), obs["instruction"],
                   seed, bool(info["success"]), np.stack(states).astype(np.float32))


def quotas(episodes: int, tasks: int) -> list[int]:
    """Episodes per task: as even as possible, the first tasks one more."""
    return [episodes // tasks + (t < episodes % tasks) for t in range(tasks)]


class _Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, total: int) -> None:
        self.total, self.start = total, time.perf_counter()
        self.enabled = sys.stderr.isatty()

    def show(self, done: int, failed: int) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        left = elapsed / done * (self.total - done) if done else 0.0
        filled = 24 * done // self.total
        sys.stderr.write(f"\rvla-data [{'#' * filled}{'.' * (24 - filled)}] {done}/"
                         f"{self.total} episodes, {failed} failed, {left:.0f} s left \033[K")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _collect(name: str, tasks: int, want: list[int], seed: int, image_size: int,
             noise: float, workers: int, progress: _Progress) -> list[dict[int, Episode | None]]:
    """Per task, attempt -> episode (None: failed) until each has its quota of successes."""
    found: list[dict[int, Episode | None]] = [{} for _ in range(tasks)]
    issued = [0] * tasks
    context = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        pending: dict[futures.Future, int] = {}

        def issue(t: int, count: int) -> None:
            for start in range(issued[t], issued[t] + count, CHUNK):
                attempts = range(start, min(start + CHUNK, issued[t] + count))
                pending[pool.submit(run_chunk, name, t, attempts, seed, image_size, noise)] = t
            issued[t] += count

        for t in range(tasks):
            issue(t, want[t])
        while pending:
            done, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
            for future in done:
                t = pending.pop(future)
                found[t].update(future.result())
                progress.show(sum(min(want[i], _successes(found[i])) for i in range(tasks)),
                              sum(_failures(f) for f in found))
                if len(found[t]) == issued[t] and _successes(found[t]) < want[t]:
                    if issued[t] >= 3 * want[t] + 20:
                        raise MeshtronError(f"the expert of task {t} failed {_failures(found[t])}"
                                            f" of {issued[t]} episodes; lower the noise")
                    issue(t, want[t] - _successes(found[t]))
    return found


def _successes(found: dict[int, Episode | None]) -> int:
    return sum(e is not None for e in found.values())


def _failures(found: dict[int, Episode | None]) -> int:
    return sum(e is None for e in found.values())


def round_robin(per_task: list[list[Episode]]) -> list[Episode]:
    """Episode k of every task, then k + 1: the validation tail (the last episodes) holds
    several tasks, not only the last one."""
    longest = max(map(len, per_task), default=0)
    return [episodes[k] for k in range(longest) for episodes in per_task if k < len(episodes)]


def generate_metaworld(name: str, episodes: int, seed: int, image_size: int,
                       output: str | Path, log: Callable[[str], object] = print, *,
                       noise: float = MOTION_NOISE, workers: int | None = None) -> Path:
    """Write ``episodes`` successful expert episodes of Meta-World environment ``name`` to the
    dataset ``output`` (tasks in turn, attempts in order); returns its path."""
    from meshtron.envs.metaworld_tasks import dataset_env_id, tasks_of, vocabulary

    tasks = tasks_of(name)
    want = quotas(episodes, len(tasks))
    workers = workers or max(1, min(len(os.sched_getaffinity(0)), 8))
    start, progress = time.perf_counter(), _Progress(episodes)
    found = _collect(name, len(tasks), want, seed, image_size, noise, workers, progress)
    progress.close()
    kept = [[e for _, e in sorted(attempts.items()) if e is not None][:want[t]]
            for t, attempts in enumerate(found)]
    frames = 0
    with EpisodeWriter(output, env=dataset_env_id(name), words=vocabulary()) as writer:
        for episode in round_robin(kept):
            writer.add(episode)
            frames += len(episode)
        path = writer.close()
    failed = sum(map(_failures, found))
    seconds = time.perf_counter() - start
    log(f"vla-data: {episodes} expert episodes of {name} ({frames} frames, {failed} failed "
        f"and skipped) in {seconds:.1f} s on {workers} processes -> {path}")
    return path
