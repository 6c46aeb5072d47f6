"""A vision-language-action policy's training data: demonstrations as observation windows.

Every frame of a demonstration is one sample: the camera image, the episode's instruction and
the next ``action_chunk`` expert actions (the last action repeats past the episode's end). Its
token window is ``patches`` placeholders (the model puts the image there), the instruction
left-padded to ``instruction_len``, the readout token's placeholder (``model.vision.keypoints``),
the state token's placeholder (``model.vision.state_dims``) and the action tokens; every token
but the actions is stored as
-(id + 1), "read, never predicted", so the loss counts the action tokens only
(:class:`~meshtron.parallel.context.sequence.SequenceSplit` undoes it). A row of a batch is
that window followed by the image's pixels and, with a state, the state's float32 bits
(:meth:`Observations.rows` packs it,
:class:`ObservationRows` unpacks it), so batches split over data parallelism and micro-batches
as text batches do. The last ``valid_fraction`` of the episodes (at least one) is held out for
validation; global batch k is a function of (seed, k) as for text (:class:`GlobalSampler`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from meshtron.config import Config, VisionConfig
from meshtron.config.kinds import STATE, VISION
from meshtron.data.demonstrations import default_demonstrations
from meshtron.data.episodes import EpisodeDataset
from meshtron.data.sampler import GlobalSampler
from meshtron.data.tokenizer import Tokenizer
from meshtron.data.vla_tokens import ActionCodec, vla_tokenizer
from meshtron.envs import DEFAULT_ENV, env_spec
from meshtron.errors import MeshtronError

DEFAULT_EPISODES = 10_000
"""Demonstrations generated when a vision model is given no data.path."""
DEFAULT_METAWORLD_EPISODES = 300
"""The same for a Meta-World environment (its episodes cost ~2 s of CPU each, not 2 ms)."""
DEFAULT_DATA_SEED = 0
"""Their seed: the default set is the same for every training seed (and cached once)."""


@dataclass(frozen=True)
class ObservationRows:
    """The row format of observation batches: the token window, then the image's pixels (a
    :class:`~meshtron.parallel.context.sequence.RowFormat`)."""

    image_shape: tuple[int, int, int]
    """[H, W, C] of one camera image."""
    state_dims: int = 0
    """Entries of the proprioceptive state after the pixels (0: none)."""

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Rows [b, S + 1 + pixels (+ state)] -> windows [b, S + 1] and the images, uint8 [b,
        H, W, C], as the policy's ``vision`` input (and the states, float32 [b, D], as its
        ``state`` input, bit for bit as stored)."""
        pixels, dims = math.prod(self.image_shape), self.state_dims
        body, state = rows[:, :rows.shape[1] - dims], rows[:, rows.shape[1] - dims:]
        window, image = body[:, :-pixels], body[:, -pixels:]
        inputs = {VISION: image.to(torch.uint8).view(rows.shape[0], *self.image_shape)}
        if dims:
            inputs[STATE] = state.to(torch.int32).view(torch.float32)
        return window, inputs


@dataclass
class Observations:
    """Samples as the model reads them: windows int64 [n, S + 1], images uint8 [n, H, W, C]
    and, for a policy that reads it, the proprioceptive states float32 [n, D]."""

    windows: np.ndarray
    images: np.ndarray
    states: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.windows)

    def rows(self, index: np.ndarray) -> torch.Tensor:
        """Samples ``index`` as batch rows: the window, the image's pixels, then the state's
        float32 bits (int64 rows carry them exactly)."""
        parts = [self.windows[index],
                 self.images[index].reshape(len(index), -1).astype(np.int64)]
        if self.states is not None:
            parts.append(self.states[index].view(np.int32).astype(np.int64))
        return torch.from_numpy(np.concatenate(parts, axis=1))


def encode_instruction(tokenizer: Tokenizer, instruction: str, length: int) -> list[int]:
    """The instruction's token ids padded on the left to ``length`` (pad id 0), so that its
    last words sit next to the actions whatever its length; unknown words and instructions
    that do not fit are refused."""
    ids = tokenizer.encode(instruction)
    if 0 in ids:
        unknown = [w for w in instruction.lower().split() if tokenizer.encode(w) == [0]]
        raise MeshtronError(f"instruction {instruction!r} has words outside the policy's "
                            f"vocabulary ({', '.join(unknown) or 'unknown'})")
    if len(ids) > length:
        raise MeshtronError(f"instruction {instruction!r} is {len(ids)} tokens, more than "
                            f"model.vision.instruction_len={length}")
    return [0] * (length - len(ids)) + ids


def observation_window(vision: VisionConfig, instruction_ids: list[int],
                       action_ids: np.ndarray) -> np.ndarray:
    """One sample's window [S + 1]: patch placeholders, instruction, readout and state
    placeholders (all read only), actions."""
    read_only = np.asarray([0] * vision.num_patches + instruction_ids
                           + [0] * (vision.readout_tokens + vision.state_tokens), dtype=np.int64)
    return np.concatenate([-read_only - 1, np.asarray(action_ids, dtype=np.int64).ravel()])


def episode_observations(vision: VisionConfig, tokenizer: Tokenizer, codec: ActionCodec,
                         images: np.ndarray, actions: np.ndarray, instruction: str,
                         states: np.ndarray | None = None) -> Observations:
    """Every frame of one episode as a sample (its next ``action_chunk`` actions; the first
    ``state_dims`` entries of its states when the policy reads them)."""
    steps, chunk = len(actions), vision.action_chunk
    ahead = np.minimum(np.arange(steps)[:, None] + np.arange(chunk)[None, :], steps - 1)
    action_ids = codec.encode(actions[ahead]).reshape(steps, -1)
    instruction_ids = encode_instruction(tokenizer, instruction, vision.instruction_len)
    windows = np.stack([observation_window(vision, instruction_ids, a) for a in action_ids])
    if not vision.state_tokens:
        return Observations(windows, images)
    assert states is not None
    return Observations(windows, images,
                        np.ascontiguousarray(states[:, :vision.state_dims], dtype=np.float32))


def _observations_of(dataset: EpisodeDataset, episodes: range, vision: VisionConfig,
                     tokenizer: Tokenizer, codec: ActionCodec) -> Observations:
    parts = [episode_observations(vision, tokenizer, codec, episode.images, episode.actions,
                                  episode.instruction, episode.states)
             for episode in map(dataset.__getitem__, episodes)]
    return Observations(np.concatenate([p.windows for p in parts]),
                        np.concatenate([p.images for p in parts]),
                        np.concatenate([p.states for p in parts]) if vision.state_tokens
                        else None)


@dataclass
class VLATrainingData:
    """Tokenizer plus training and validation observations, served as whole global batches
    (the trainer's interface of :class:`~meshtron.data.training_data.TrainingData`)."""

    tokenizer: Tokenizer
    train: Observations
    valid: Observations
    seq_len: int
    seed: int
    codec: ActionCodec
    vision: VisionConfig
    """The model's vision section with the action range resolved (the dataset's unless set)."""
    _samplers: dict[int, GlobalSampler] = field(default_factory=dict, repr=False)

    def train_batch(self, k: int, global_batch: int) -> torch.Tensor:
        """Global batch ``k`` [global_batch, S + 1 + pixels], a function of (seed, k) only."""
        if global_batch not in self._samplers:
            self._samplers[global_batch] = GlobalSampler(len(self.train), global_batch,
                                                         self.seed)
        return self.train.rows(self._samplers[global_batch].batch_indices(k))

    def valid_batch(self, k: int, batch: int) -> torch.Tensor:
        """Validation batch ``k``: samples in fixed order, wrapping around at the end."""
        return self.valid.rows(np.arange(k * batch, (k + 1) * batch) % len(self.valid))

    def resolved(self, cfg: Config) -> Config:
        """``cfg`` with the model's action range as these observations were encoded with."""
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                  vision=self.vision))


def build_policy_data(cfg: Config, log: Callable[[str], None] = print,
                      tokenizer: Tokenizer | None = None) -> VLATrainingData:
    """The trainer's entry point for a vision model: ``data.path`` (one demonstration folder)
    or the default demonstrations, generated once into the cache; ``tokenizer`` (default
    ``data.tokenizer``, else the word-level tokenizer of the task's instructions and the
    model's action bins)."""
    vision, data = cfg.model.vision, cfg.data
    cache_dir = os.path.expanduser(data.cache_dir)
    if data.path:
        if len(data.path) > 1:
            raise MeshtronError(f"data.path names {len(data.path)} datasets; a vision model "
                                "trains on one demonstration folder")
        path = Path(data.path[0]).expanduser()
    else:
        episodes = DEFAULT_EPISODES if vision.env == DEFAULT_ENV else DEFAULT_METAWORLD_EPISODES
        path = default_demonstrations(cache_dir, episodes, DEFAULT_DATA_SEED,
                                      vision.image_size, log, env=vision.env,
                                      states=bool(vision.state_tokens))
    dataset = EpisodeDataset.open(path)
    expected = env_spec(vision.env).dataset_env
    if dataset.env != expected:
        raise MeshtronError(f"{path} holds demonstrations of {dataset.env}, but "
                            f"model.vision.env={vision.env} (its data is {expected})")
    if tokenizer is None:
        tokenizer = (Tokenizer.load(data.tokenizer) if data.tokenizer else
                     vla_tokenizer(dataset.words, vision.action_bins, cache_dir))
    return build_vla_data(vision, dataset, tokenizer, cfg.train.seed, data.valid_fraction, log)


def build_vla_data(vision: VisionConfig, dataset: EpisodeDataset, tokenizer: Tokenizer,
                   seed: int, valid_fraction: float,
                   log: Callable[[str], None] = print) -> VLATrainingData:
    """Observations of ``dataset``'s demonstrations for the model of ``vision``, checked
    against its image size and action dimensions; its action range unless set is the
    dataset's."""
    path = dataset.path
    if dataset.image_size != vision.image_size:
        raise MeshtronError(f"{path} holds {dataset.image_size}x{dataset.image_size} images, "
                            f"but model.vision.image_size={vision.image_size}")
    if dataset.action_dims != vision.action_dims:
        raise MeshtronError(f"{path} holds {dataset.action_dims}-dimensional actions, but "
                            f"model.vision.action_dims={vision.action_dims}")
    if dataset.state_dims < vision.state_dims:
        raise MeshtronError(f"{path} records {dataset.state_dims} state entries per frame, but "
                            f"model.vision.state_dims={vision.state_dims}; write the "
                            "demonstrations again with `meshtron vla-data` (which records the "
                            "state) or set model.vision.state_dims=0")
    if len(dataset) < 2:
        raise MeshtronError(f"{path} holds {len(dataset)} episode(s); training and validation "
                            "need at least 2")
    if vision.action_low is None:
        vision = dataclasses.replace(vision, action_low=[float(x) for x in dataset.action_low],
                                     action_high=[float(x) for x in dataset.action_high])
    codec = ActionCodec.of(tokenizer, vision.action_low, vision.action_high, vision.action_bins)
    held = min(len(dataset) - 1, max(1, round(len(dataset) * valid_fraction)))
    cut = len(dataset) - held
    train = _observations_of(dataset, range(cut), vision, tokenizer, codec)
    valid = _observations_of(dataset, range(cut, len(dataset)), vision, tokenizer, codec)
    log(f"dataset: {path}: {len(dataset)} episodes, {len(train):,} train observations "
        f"({cut} episodes), {len(valid):,} valid ({held})")
    return VLATrainingData(tokenizer, train, valid, vision.seq_len, seed, codec, vision)
