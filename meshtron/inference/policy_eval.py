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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from meshtron.data.builders import row_format
from meshtron.data.tokenizer import Tokenizer
from meshtron.data.vla_data import VLATrainingData, encode_instruction
from meshtron.data.vla_tokens import ActionCodec
from meshtron.envs import DEFAULT_ENV, make_env
from meshtron.envs.tabletop import TabletopState, block_under
from meshtron.models.policy_runner import PolicyRunner
from meshtron.parallel.context.sequence import SequenceSplit
from meshtron.parallel.mesh.groups import ParallelMesh

EVAL_SEED_BASE = 2**32
"""Seed of the first evaluation episode: far from the demonstrations' seeds."""


OUTCOMES = ("success", "other_block", "table", "timeout")
"""How an episode ends: closed over the named block, over another block, over bare table, or
not closed within the step limit."""


@dataclass
class Episode:
    seed: int
    instruction: str
    success: bool
    steps: int
    episode_return: float
    frames: list[np.ndarray]
    outcome: str = "timeout"
    """One of :data:`OUTCOMES`."""


def outcome_of(state: TabletopState) -> str:
    """How the episode of final ``state`` ended (:data:`OUTCOMES`)."""
    if state.success:
        return "success"
    if not state.closed:
        return "timeout"
    return "table" if block_under(state, *state.gripper) is None else "other_block"


@dataclass
class Evaluation:
    episodes: list[Episode]
    action_token_accuracy: float
    latency_s: float
    """Median seconds of one control step (one observation -> its actions) at batch 1."""

    @property
    def success_rate(self) -> float:
        return sum(e.success for e in self.episodes) / len(self.episodes)

    @property
    def mean_return(self) -> float:
        return statistics.fmean(e.episode_return for e in self.episodes)

    @property
    def outcomes(self) -> dict[str, int]:
        """Episodes by how they ended, every one of :data:`OUTCOMES` present."""
        return {name: sum(e.outcome == name for e in self.episodes) for name in OUTCOMES}

    def summary(self) -> dict[str, Any]:
        """The JSON of ``meshtron evaluate --json``."""
        return {"success_rate": self.success_rate, "episodes": len(self.episodes),
                "outcomes": self.outcomes,
                "mean_return": self.mean_return,
                "action_token_accuracy": self.action_token_accuracy,
                "latency_ms": 1000 * self.latency_s,
                "control_steps_per_s": 1.0 / self.latency_s}


class PolicyActor:
    """Observations -> continuous action chunks through the policy and its action codec."""

    def __init__(self, runner: PolicyRunner, codec: ActionCodec, tokenizer: Tokenizer) -> None:
        self.runner, self.codec, self.tokenizer = runner, codec, tokenizer
        self.vision = runner.vision

    def __call__(self, images: list[np.ndarray], instructions: list[str]) -> np.ndarray:
        """Action chunks float32 [b, action_chunk, action_dims]."""
        ids = torch.tensor([encode_instruction(self.tokenizer, text, self.vision.instruction_len)
                            for text in instructions])
        tokens = self.runner.act(torch.from_numpy(np.stack(images)), ids)
        actions = self.codec.decode(tokens.numpy())
        return actions.reshape(len(images), self.vision.action_chunk, self.vision.action_dims)


def rollouts(actor: PolicyActor, count: int, image_size: int, batch: int = 16,
             keep_frames: int = 0, env_name: str = DEFAULT_ENV) -> list[Episode]:
    """``count`` episodes of environment ``env_name`` from seeds EVAL_SEED_BASE..; the frames of
    the first ``keep_frames`` are kept (for videos)."""
    episodes = []
    for first in range(0, count, batch):
        seeds = list(range(EVAL_SEED_BASE + first, EVAL_SEED_BASE + min(count, first + batch)))
        envs = [make_env(env_name, image_size=image_size) for _ in seeds]
        obs = [env.reset(seed=seed)[0] for env, seed in zip(envs, seeds, strict=True)]
        results = [Episode(seed, o["instruction"], False, 0, 0.0, [o["image"]])
                   for seed, o in zip(seeds, obs, strict=True)]
        running = list(range(len(envs)))
        while running:
            chunks = actor([obs[i]["image"] for i in running],
                           [obs[i]["instruction"] for i in running])
            still = []
            for i, chunk in zip(running, chunks, strict=True):
                done = False
                for action in chunk:
                    obs[i], reward, terminated, truncated, info = envs[i].step(action)
                    episode = results[i]
                    episode.steps += 1
                    episode.episode_return += reward
                    episode.success = bool(info["success"])
                    if first + i < keep_frames:
                        episode.frames.append(obs[i]["image"])
                    done = terminated or truncated
                    if done:
                        episode.outcome = outcome_of(envs[i].state)
                        break
                if not done:
                    still.append(i)
            running = still
        episodes.extend(results)
    for index, episode in enumerate(episodes):
        if index >= keep_frames:
            episode.frames = []
    return episodes


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
                    env_name: str = DEFAULT_ENV) -> float:
    """Median seconds of one observation -> action chunk at batch 1 (after one warm-up)."""
    env = make_env(env_name, image_size=image_size)
    obs, _ = env.reset(seed=EVAL_SEED_BASE - 1)
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        actor([obs["image"]], [obs["instruction"]])
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def evaluate_policy(actor: PolicyActor, data: VLATrainingData, episodes: int,
                    keep_frames: int = 0,
                    log: Callable[[str], None] = print) -> Evaluation:
    """Rollouts, held-out action-token accuracy and control latency of one policy."""
    image_size = actor.vision.image_size
    accuracy = action_token_accuracy(actor.runner, data)
    log(f"action-token accuracy on {len(data.valid):,} held-out observations: "
        f"{100 * accuracy:.1f}%")
    latency = control_latency(actor, image_size)
    done = rollouts(actor, episodes, image_size, keep_frames=keep_frames)
    return Evaluation(done, accuracy, latency)
