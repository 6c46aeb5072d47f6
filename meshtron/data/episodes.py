"""Demonstration episodes on disk: safetensors shards plus one JSON index, no pickle.

A dataset is a directory::

    episodes.json            the index (below), checked before any shard is read
    shard-00000.safetensors  images uint8 [T, H, W, 3], actions float32 [T, A], offsets
    shard-00001.safetensors  int64 [E + 1] and, with a state, states float32 [T, D]: frames
    ...                      of E episodes back to back

The index holds ``format`` and ``version``; ``env`` (the task's name and version);
``image_size``; ``action_dims``; ``state_dims`` (the proprioceptive state's entries per
frame, 0 or absent: none recorded); ``action_low`` / ``action_high`` (per dimension, over the
data); ``words`` (the task's fixed instruction vocabulary, to build a tokenizer from);
``num_episodes`` and ``num_frames``; ``shards`` (file, episodes, frames each); and
``episodes``: per episode its ``instruction``, ``length``, ``seed``, ``success``, ``shard`` and
``offset`` (first frame within the shard). Frame t of an episode is the observation the action
at t was taken from. A dataset is written into a temporary directory and renamed into place, so
a crash never leaves one that looks complete; reading it back gives exactly what was written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from meshtron.errors import MeshtronError
from meshtron.files import os_reason

FORMAT = "meshtron-episodes"
VERSION = 1
INDEX = "episodes.json"
FRAMES_PER_SHARD = 16384


def episode_seed(seed: int, index: int) -> int:
    """The environment seed (32 bits) of episode ``index`` of a set generated with ``seed``."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint32)[0])


@dataclasses.dataclass(frozen=True, eq=False)
class Episode:
    """One demonstration: the observation and the action taken at each of its T steps."""

    images: np.ndarray
    """uint8 [T, H, W, 3]."""
    actions: np.ndarray
    """float32 [T, A]."""
    instruction: str
    seed: int | None = None
    """The environment seed that replays it; held-out evaluation seeds avoid these."""
    success: bool = True
    states: np.ndarray | None = None
    """float32 [T, D]: the proprioceptive state of each frame (Meta-World's hand position and
    gripper opening), or None when not recorded."""

    def __len__(self) -> int:
        return len(self.actions)


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


class EpisodeWriter:
    """Adds episodes one by one, writing a shard whenever ``frames_per_shard`` frames are due;
    the dataset appears at ``output_dir`` only on :meth:`close`. As a context manager, a
    failure removes the partial temporary directory instead."""

    def __init__(self, output_dir: str | Path, *, env: str, words: Sequence[str] = (),
                 frames_per_shard: int = FRAMES_PER_SHARD) -> None:
        self.output_dir = Path(output_dir)
        _check_replaceable(self.output_dir)
        self.tmp_dir = self.output_dir.with_name(f".{self.output_dir.name}.{os.getpid()}.tmp")
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
        try:
            self.tmp_dir.mkdir(parents=True)
        except OSError as err:
            raise MeshtronError(f"cannot create {self.tmp_dir} ({os_reason(err)})") from None
        self.env, self.words, self.frames_per_shard = env, list(words), frames_per_shard
        self._pending: list[Episode] = []
        self._pending_frames = 0
        self._entries: list[dict[str, Any]] = []
        self._shards: list[dict[str, Any]] = []
        self._shape: tuple[int, ...] | None = None
        self._state_dims: int | None = None
        self._low: np.ndarray | None = None
        self._high: np.ndarray | None = None

    def add(self, episode: Episode) -> None:
        images, actions = episode.images, episode.actions
        shape = (images.shape[1:], actions.shape[1:])
        if (images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3
                or images.shape[1] != images.shape[2] or actions.dtype != np.float32
                or actions.ndim != 2 or len(images) != len(actions) or len(actions) == 0):
            raise MeshtronError("an episode needs uint8 images [T, S, S, 3] and float32 actions "
                                f"[T, A] with T > 0, got {images.dtype} {list(images.shape)} "
                                f"and {actions.dtype} {list(actions.shape)}")
        if self._shape is not None and shape != self._shape:
            raise MeshtronError(f"episode shapes differ: {shape} after {self._shape}")
        self._shape = shape
        self._check_states(episode)
        low, high = actions.min(axis=0), actions.max(axis=0)
        self._low = low if self._low is None else np.minimum(self._low, low)
        self._high = high if self._high is None else np.maximum(self._high, high)
        self._pending.append(episode)
        self._pending_frames += len(episode)
        if self._pending_frames >= self.frames_per_shard:
            self._flush()

    def _check_states(self, episode: Episode) -> None:
        """Every episode of a dataset records a state of one width, or none does."""
        states = episode.states
        dims = 0 if states is None else int(states.shape[-1]) if states.ndim == 2 else -1
        if states is not None and (states.dtype != np.float32 or dims <= 0
                                   or len(states) != len(episode)):
            raise MeshtronError(f"an episode's states must be float32 [T, D] with T = "
                                f"{len(episode)}, got {states.dtype} {list(states.shape)}")
        if self._state_dims is not None and dims != self._state_dims:
            raise MeshtronError(f"episodes record states of {dims} entries after "
                                f"{self._state_dims} (0: none)")
        self._state_dims = dims

    def close(self) -> Path:
        """Write the last shard and the index, then move the dataset into place."""
        self._flush()
        if not self._entries or self._shape is None:
            raise MeshtronError(f"no episodes to write to {self.output_dir}")
        assert self._low is not None and self._high is not None
        (image_shape, action_shape) = self._shape
        index = {
            "format": FORMAT, "version": VERSION, "env": self.env,
            "image_size": int(image_shape[0]), "action_dims": int(action_shape[0]),
            "state_dims": self._state_dims or 0,
            "action_low": [float(v) for v in self._low],
            "action_high": [float(v) for v in self._high], "words": self.words,
            "num_episodes": len(self._entries),
            "num_frames": sum(e["length"] for e in self._entries),
            "shards": self._shards, "episodes": self._entries,
        }
        try:
            (self.tmp_dir / INDEX).write_text(json.dumps(index, indent=1) + "\n")
            _replace_dir(self.tmp_dir, self.output_dir)
        except OSError as err:
            raise MeshtronError(f"cannot write {self.output_dir} ({os_reason(err)})") from None
        return self.output_dir

    def abort(self) -> None:
        shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def __enter__(self) -> EpisodeWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is not None:
            self.abort()

    def _flush(self) -> None:
        if not self._pending:
            return
        number, episodes = len(self._shards), self._pending
        lengths = np.array([len(e) for e in episodes], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tensors = {"images": np.concatenate([e.images for e in episodes]),
                   "actions": np.concatenate([e.actions for e in episodes]),
                   "offsets": offsets}
        if self._state_dims:
            tensors["states"] = np.concatenate([e.states for e in episodes])
        try:
            save_file(tensors, self.tmp_dir / shard_name(number), metadata={"format": FORMAT})
        except (OSError, SafetensorError) as err:
            self.abort()
            raise MeshtronError(f"cannot write a shard of {self.output_dir} ({err})") from None
        self._shards.append({"file": shard_name(number), "episodes": len(episodes),
                             "frames": int(offsets[-1])})
        for episode, offset in zip(episodes, offsets[:-1]):
            self._entries.append({
                "instruction": episode.instruction, "length": len(episode),
                "seed": None if episode.seed is None else int(episode.seed),
                "success": bool(episode.success), "shard": number, "offset": int(offset)})
        self._pending, self._pending_frames = [], 0


def write_episodes(output_dir: str | Path, episodes: Iterable[Episode], *, env: str,
                   words: Sequence[str] = (), frames_per_shard: int = FRAMES_PER_SHARD) -> Path:
    """Write ``episodes`` as a dataset at ``output_dir`` (replacing an earlier dataset there)."""
    with EpisodeWriter(output_dir, env=env, words=words,
                       frames_per_shard=frames_per_shard) as writer:
        for episode in episodes:
            writer.add(episode)
        return writer.close()


def _check_replaceable(path: Path) -> None:
    """Refuse to overwrite anything but an earlier episode dataset or an empty directory."""
    if path.is_file():
        raise MeshtronError(f"{path} is a file, not a directory for episodes")
    if path.is_dir() and any(path.iterdir()) and not (path / INDEX).is_file():
        raise MeshtronError(f"{path} exists and is not an episode dataset; pick another place")


def _replace_dir(new: Path, target: Path) -> None:
    old = target.with_name(f".{target.name}.{os.getpid()}.old")
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


class EpisodeDataset:
    """A dataset read back whole: every frame as one array, episodes as slices of it."""

    def __init__(self, path: Path, index: dict[str, Any], images: np.ndarray,
                 actions: np.ndarray, states: np.ndarray | None = None) -> None:
        self.path, self.index = path, index
        self.images, self.actions, self.states = images, actions, states
        """All frames of all episodes in index order: uint8 [N, H, W, 3], float32 [N, A] and
        float32 [N, D] (None: the dataset records no state)."""
        self.state_dims = 0 if states is None else int(states.shape[1])
        lengths = np.array([e["length"] for e in index["episodes"]], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.lengths = lengths
        self.episode_of_frame = np.repeat(np.arange(len(lengths)), lengths)
        """The episode (index) each frame belongs to: int64 [N]."""
        self.instructions = [e["instruction"] for e in index["episodes"]]
        self.seeds = [e["seed"] for e in index["episodes"]]
        self.image_size: int = index["image_size"]
        self.action_dims: int = index["action_dims"]
        self.action_low = np.array(index["action_low"], dtype=np.float32)
        self.action_high = np.array(index["action_high"], dtype=np.float32)
        self.env: str = index["env"]
        self.words: tuple[str, ...] = tuple(index["words"])

    @classmethod
    def open(cls, path: str | Path) -> EpisodeDataset:
        """Read the dataset at ``path``; any damage is one :class:`MeshtronError` line."""
        path = Path(path)
        if not path.is_dir():
            raise MeshtronError(f"episode dataset {path} does not exist (or is not a directory)")
        index = read_index(path)
        order = [(e["shard"], e["offset"]) for e in index["episodes"]]
        if order != sorted(order):
            raise MeshtronError(f"{path / INDEX} lists episodes out of shard order")
        images, actions, states = [], [], []
        for number, shard in enumerate(index["shards"]):
            entries = [e for e in index["episodes"] if e["shard"] == number]
            tensors = _read_shard(path, shard, entries, index)
            images.append(tensors["images"])
            actions.append(tensors["actions"])
            states.append(tensors.get("states"))
        return cls(path, index, np.concatenate(images), np.concatenate(actions),
                   np.concatenate(states) if index.get("state_dims") else None)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Episode:
        if not -len(self) <= i < len(self):
            raise IndexError(f"episode {i} of {len(self)}")
        entry = self.index["episodes"][i]
        frames = slice(int(self.starts[i]), int(self.starts[i] + self.lengths[i]))
        return Episode(self.images[frames], self.actions[frames], entry["instruction"],
                       entry["seed"], entry["success"],
                       None if self.states is None else self.states[frames])


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "format": str, "version": int, "env": str, "image_size": int, "action_dims": int,
    "action_low": list, "action_high": list, "words": list, "num_episodes": int,
    "num_frames": int, "shards": list, "episodes": list}
_SHARD_FIELDS: dict[str, type | tuple[type, ...]] = {"file": str, "episodes": int, "frames": int}
_EPISODE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "instruction": str, "length": int, "seed": (int, type(None)), "success": bool,
    "shard": int, "offset": int}


def read_index(path: Path) -> dict[str, Any]:
    """The index of the dataset at ``path``, its fields and counts checked."""
    file = path / INDEX
    try:
        index = json.loads(file.read_text())
    except FileNotFoundError:
        raise MeshtronError(f"{path} is not an episode dataset: {INDEX} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MeshtronError(f"cannot read the episode index {file} ({err})") from None
    _check_fields(index, _FIELDS, file, "the index")
    if index["format"] != FORMAT or index["version"] != VERSION:
        raise MeshtronError(f"{file} is {index['format']} version {index['version']}, not "
                            f"{FORMAT} version {VERSION}")
    for shard in index["shards"]:
        _check_fields(shard, _SHARD_FIELDS, file, "a shard entry")
    for entry in index["episodes"]:
        _check_fields(entry, _EPISODE_FIELDS, file, "an episode entry")
        if not 0 <= entry["shard"] < len(index["shards"]):
            raise MeshtronError(f"{file} has an episode in shard {entry['shard']}, outside its "
                                f"{len(index['shards'])} shards")
        if entry["length"] < 1 or entry["offset"] < 0:
            raise MeshtronError(f"{file} has an episode of length {entry['length']} at offset "
                                f"{entry['offset']}")
    dims = index["action_dims"]
    state_dims = index.setdefault("state_dims", 0)  # absent in sets written before states
    if not isinstance(state_dims, int) or isinstance(state_dims, bool) or state_dims < 0:
        raise MeshtronError(f"{file} is not a valid episode index: state_dims is "
                            f"{state_dims!r}, not a count")
    if len(index["action_low"]) != dims or len(index["action_high"]) != dims:
        raise MeshtronError(f"{file}: action_low/high do not have action_dims={dims} entries")
    counts = [(len(index["episodes"]), sum(s["episodes"] for s in index["shards"])),
              (sum(e["length"] for e in index["episodes"]),
               sum(s["frames"] for s in index["shards"]))]
    if counts[0] != (index["num_episodes"],) * 2 or counts[1] != (index["num_frames"],) * 2:
        raise MeshtronError(
            f"{file} disagrees with itself: num_episodes={index['num_episodes']} and "
            f"num_frames={index['num_frames']}, but it lists {counts[0][0]} episodes of "
            f"{counts[1][0]} frames and shards of {counts[0][1]} episodes, {counts[1][1]} frames")
    return index


def _check_fields(entry: Any, fields: dict[str, type | tuple[type, ...]], file: Path,
                  what: str) -> None:
    if not isinstance(entry, dict):
        raise MeshtronError(f"{file} is not a valid episode index: {what} is not an object")
    for name, kind in fields.items():
        value = entry.get(name)
        if name not in entry or not isinstance(value, kind) or (
                isinstance(value, bool) and kind is int):
            raise MeshtronError(f"{file} is not a valid episode index: {what} has no valid "
                                f"{name!r}")


def _read_shard(path: Path, shard: dict[str, Any], entries: list[dict[str, Any]],
                index: dict[str, Any]) -> dict[str, np.ndarray]:
    """A shard's images, actions (and states), checked against what the index says it
    holds."""
    file = path / shard["file"]
    if Path(shard["file"]).name != shard["file"] or not file.is_file():
        raise MeshtronError(f"episode shard {file} is missing")
    if file.stat().st_size == 0:
        raise MeshtronError(f"episode shard {file} is empty")
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError) as err:
        raise MeshtronError(f"episode shard {file} is truncated or damaged "
                            f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
                            ) from None
    size, dims, frames = index["image_size"], index["action_dims"], shard["frames"]
    expected = {"images": (np.uint8, (frames, size, size, 3)),
                "actions": (np.float32, (frames, dims)),
                "offsets": (np.int64, (shard["episodes"] + 1,))}
    if index["state_dims"]:
        expected["states"] = (np.float32, (frames, index["state_dims"]))
    for name, (dtype, shape) in expected.items():
        tensor = tensors.get(name)
        if tensor is None or tensor.dtype != dtype or tensor.shape != shape:
            found = "nothing" if tensor is None else f"{tensor.dtype} {list(tensor.shape)}"
            raise MeshtronError(f"episode shard {file} disagrees with the index: {name} should "
                                f"be {np.dtype(dtype)} {list(shape)}, found {found}")
    offsets = [e["offset"] for e in entries] + [frames]
    lengths = [e["length"] for e in entries]
    if (tensors["offsets"].tolist() != offsets
            or [b - a for a, b in zip(offsets, offsets[1:])] != lengths):
        raise MeshtronError(f"episode shard {file} disagrees with the index about where its "
                            "episodes start")
    return tensors
