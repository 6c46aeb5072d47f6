"""Closed-loop evaluation of a vision-language-action policy in the tabletop task.

Episodes start from held-out seeds (:data:`EVAL_SEED_BASE` onwards; demonstrations are
generated from other seeds) and run in lockstep batches: every environment still running
contributes its observation to one batched call of the policy, and the action chunk it gets
back is executed action by action until the episode ends. Alongside: the action-token accuracy
on the held-out demonstrations (teacher-forced), and the latency of one control step at batch 1
(the encoder once per frame, the decoder with its KV cache).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from meshtron.data.builders import row_format
from meshtron.data.tokenizer import Tokenizer
from meshtron.data.vla_data import VLATrainingData, encode_instruction
from meshtron.data.vla_tokens import ActionCodec
from meshtron.envs import DEFAULT_ENV, TabletopEnv, make_env
from meshtron.errors import MeshtronError
from meshtron.models.policy_runner import PolicyRunner
from meshtron.parallel.context.sequence import SequenceSplit
from meshtron.parallel.mesh.groups import ParallelMesh

EVAL_SEED_BASE = 2**32
"""Seed of the first evaluation episode: far from the demonstrations' seeds."""


OUTCOMES = TabletopEnv.OUTCOMES
"""The tabletop task's outcomes (every environment names its own, ``type(env).OUTCOMES``)."""


@dataclass
class Episode:
    seed: int
    instruction: str
    success: bool
    steps: int
    episode_return: float
    frames: list[np.ndarray]
    outcome: str = "timeout"
    """One of the environment's ``OUTCOMES``."""
    task: str = DEFAULT_ENV


def success_rates(episodes: list[Episode]) -> dict[str, float]:
    """Each task's share of successful episodes, tasks in the order first met."""
    tasks = dict.fromkeys(e.task for e in episodes)
    return {task: statistics.fmean(e.success for e in episodes if e.task == task)
            for task in tasks}


@dataclass
class Evaluation:
    episodes: list[Episode]
    action_token_accuracy: float
    latency_s: float
    """Median seconds of one control step (one observation -> its actions) at batch 1."""
    outcome_names: tuple[str, ...] = OUTCOMES

    @property
    def per_task(self) -> dict[str, float]:
        return success_rates(self.episodes)

    @property
    def success_rate(self) -> float:
        """The mean over tasks of their success rates (over episodes for one task)."""
        return statistics.fmean(self.per_task.values())

    @property
    def mean_return(self) -> float:
        return statistics.fmean(e.episode_return for e in self.episodes)

    @property
    def mean_length(self) -> float:
        return statistics.fmean(e.steps for e in self.episodes)

    @property
    def outcomes(self) -> dict[str, int]:
        """Episodes by how they ended, every one of the environment's outcomes present."""
        return {name: sum(e.outcome == name for e in self.episodes)
                for name in self.outcome_names}

    def summary(self) -> dict[str, Any]:
        """The JSON of ``meshtron evaluate --json``."""
        return {"success_rate": self.success_rate, "episodes": len(self.episodes),
                "per_task": self.per_task,
                "per_task_episodes": {t: sum(e.task == t for e in self.episodes)
                                      for t in self.per_task},
                "outcomes": self.outcomes,
                "mean_return": self.mean_return,
                "mean_episode_length": self.mean_length,
                "action_token_accuracy": self.action_token_accuracy,
                "latency_ms": 1000 * self.latency_s,
                "control_steps_per_s": 1.0 / self.latency_s}


class PolicyActor:
    """Observations -> continuous action chunks through the policy and its action codec."""

    def __init__(self, runner: PolicyRunner, codec: ActionCodec, tokenizer: Tokenizer) -> None:
        self.runner, self.codec, self.tokenizer = runner, codec, tokenizer
        self.vision = runner.vision

    def __call__(self, images: list[np.ndarray], instructions: list[str],
                 states: list[np.ndarray] | None = None) -> np.ndarray:
        """Action chunks float32 [b, action_chunk, action_dims]; ``states``: the observations'
        proprioceptive states, read by a policy with ``model.vision.state_dims``."""
        ids = torch.tensor([encode_instruction(self.tokenizer, text, self.vision.instruction_len)
                            for text in instructions])
        state = None
        if self.vision.state_tokens:
            if states is None or any(s is None for s in states):
                raise MeshtronError("the policy reads the proprioceptive state, but the "
                                    "environment's observations carry none")
            state = torch.from_numpy(np.stack(states)[:, :self.vision.state_dims]).float()
        tokens = self.runner.act(torch.from_numpy(np.stack(images)), ids, state)
        actions = self.codec.decode(tokens.numpy())
        return actions.reshape(len(images), self.vision.action_chunk, self.vision.action_dims)


@dataclass
class RolloutPlan:
    """Which episodes to roll out: ``count`` per task of environment ``env_name`` from seeds
    EVAL_SEED_BASE.. (the same seeds for every task), ``env_options`` for each environment."""

    env_name: str = DEFAULT_ENV
    count: int = 1
    tasks: tuple[str | None, ...] = (None,)
    """None: the environment chooses (the tabletop task has one)."""
    env_options: dict[str, Any] = field(default_factory=dict)
    batch: int = 16
    keep_frames: int = 0
    """Frames are kept for the first episodes of each task (for videos)."""


def rollouts(actor: PolicyActor, count: int, image_size: int, batch: int = 16,
             keep_frames: int = 0, env_name: str = DEFAULT_ENV,
             plan: RolloutPlan | None = None,
             progress: Callable[[list[Episode]], None] | None = None) -> list[Episode]:
    """``count`` episodes of environment ``env_name`` (or the episodes of ``plan``) from seeds
    EVAL_SEED_BASE..; the frames of the first ``keep_frames`` are kept (for videos)."""
    plan = plan or RolloutPlan(env_name, count, batch=batch, keep_frames=keep_frames)
    envs = [make_env(plan.env_name, image_size=image_size, **plan.env_options)
            for _ in range(min(plan.batch, plan.count))]
    episodes: list[Episode] = []
    try:
        for task in plan.tasks:
            for first in range(0, plan.count, plan.batch):
                seeds = range(EVAL_SEED_BASE + first,
                              EVAL_SEED_BASE + min(plan.count, first + plan.batch))
                keep = [first + i < plan.keep_frames for i in range(len(seeds))]
                episodes.extend(_lockstep(actor, envs[:len(seeds)], list(seeds), task, keep))
                if progress is not None:
                    progress(episodes)
    finally:
        for env in envs:
            env.close()
    return episodes


def _lockstep(actor: PolicyActor, envs: list, seeds: list[int], task: str | None,
              keep: list[bool]) -> list[Episode]:
    """One episode per environment, all stepping together; each runs its action chunk."""
    options = None if task is None else {"task": task}
    obs = [env.reset(seed=seed, options=options)[0] for env, seed in zip(envs, seeds)]
    results = [Episode(seed, o["instruction"], False, 0, 0.0, [o["image"]] if k else [],
                       task=task or getattr(env, "task", DEFAULT_ENV))
               for seed, o, k, env in zip(seeds, obs, keep, envs, strict=True)]
    running = list(range(len(envs)))
    while running:
        chunks = actor([obs[i]["image"] for i in running],
                       [obs[i]["instruction"] for i in running],
                       [obs[i].get("state") for i in running])
        still = []
        for i, chunk in zip(running, chunks, strict=True):
            done, episode = False, results[i]
            for action in chunk:
                obs[i], reward, terminated, truncated, info = envs[i].step(action)
                episode.steps += 1
                episode.episode_return += reward
                episode.success = bool(info["success"])
                if keep[i]:
                    episode.frames.append(obs[i]["image"])
                done = terminated or truncated
                if done:
                    episode.outcome = envs[i].outcome()
                    break
            if not done:
                still.append(i)
        running = still
    return results


def action_token_accuracy(runner: PolicyRunner, data: VLATrainingData,
                          batch: int = 64) -> float:
    """Greedy action tokens equal to the expert's on every held-out observation."""
    split = SequenceSplit(ParallelMesh.single().cp, rows=row_format(runner.model.cfg))
    correct = counted = 0
    for start in range(0, len(data.valid), batch):
        index = np.arange(start, min(len(data.valid), start + batch))
        mb = split(data.valid.rows(index))
        right, total = runner.token_accuracy(mb.tokens, mb.targets, mb.inputs)
        correct, counted = correct + right, counted + total
    return correct / counted


def control_latency(actor: PolicyActor, image_size: int, steps: int = 20,
                    env_name: str = DEFAULT_ENV, **env_options: Any) -> float:
    """Median seconds of one observation -> action chunk at batch 1 (after one warm-up)."""
    env = make_env(env_name, image_size=image_size, **env_options)
    try:
        obs, _ = env.reset(seed=EVAL_SEED_BASE - 1)
    finally:
        env.close()
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        actor([obs["image"]], [obs["instruction"]], [obs.get("state")])
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def evaluate_policy(actor: PolicyActor, data: VLATrainingData, episodes: int,
                    keep_frames: int = 0, log: Callable[[str], None] = print,
                    plan: RolloutPlan | None = None,
                    progress: Callable[[list[Episode]], None] | None = None) -> Evaluation:
    """Rollouts (``plan``, default ``episodes`` of the tabletop task), held-out action-token
    accuracy and control latency of one policy."""
    image_size = actor.vision.image_size
    plan = plan or RolloutPlan(count=episodes, keep_frames=keep_frames)
    accuracy = action_token_accuracy(actor.runner, data)
    log(f"action-token accuracy on {len(data.valid):,} held-out observations: "
        f"{100 * accuracy:.1f}%")
    latency = control_latency(actor, image_size, env_name=plan.env_name, **plan.env_options)
    done = rollouts(actor, episodes, image_size, plan=plan, progress=progress)
    return Evaluation(done, accuracy, latency, type_outcomes(plan.env_name))


def type_outcomes(env_name: str) -> tuple[str, ...]:
    """The outcome names of environment ``env_name``, without building it."""
    if env_name == DEFAULT_ENV:
        return OUTCOMES
    from meshtron.envs.metaworld_tasks import OUTCOMES as metaworld_outcomes

    return metaworld_outcomes
