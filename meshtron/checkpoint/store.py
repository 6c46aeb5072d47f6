"""Crash-safe checkpoint directories: per-rank shard files plus one JSON manifest.

Layout under a checkpoint root::

    step_00000100/              a complete checkpoint
        meta.json               manifest: step, config, checksum of every file, the tensor index
                                (global name -> shape, dtype, pieces), RNG keys, user metadata
        shard-00000.safetensors one per rank that holds something; never pickled
        shard-00000.json        that rank's part of the index (merged into meta.json)
        tokenizer.json
    latest                      name of the newest complete checkpoint, updated last
    .tmp-step_00000200-<token>/ a save in progress (or a crashed one): never loaded

Every rank writes its shard into the temporary directory; the first rank waits for all shard
indexes, writes the manifest, fsyncs, renames the directory into place and only then updates
``latest``. A step directory exists only complete; its files are verified against their
checksums when read (see :mod:`meshtron.checkpoint.shards`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from meshtron.checkpoint.digests import file_digest
from meshtron.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    STEP_DIR,
    read_manifest,
    verify_files,
)
from meshtron.checkpoint.shards import (
    Piece,
    ShardReader,
    fsync_file,
    merge_shard_indexes,
    shard_name,
    write_shard,
)
from meshtron.errors import MeshtronError

LATEST = "latest"
ON_CORRUPT = ("error", "previous")
ON_CORRUPT_HINT = "set checkpoint.on_corrupt=previous to fall back to the one before it"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def temp_dir(root: Path, step: int, token: str) -> Path:
    """Where a save of ``step`` is assembled; ``token`` is shared by the ranks of one run."""
    return root / f".tmp-{step_dir_name(step)}-{token}"


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finalize_checkpoint(tmp: Path, root: Path, step: int, world_size: int, meta: dict[str, Any],
                        copy_files: dict[str, Path] | None = None, keep_last: int = 0,
                        timeout_s: float = 600.0) -> Path:
    """First rank: wait for every rank's shard index in ``tmp``, write the manifest, move the
    directory into place, then point ``latest`` at it."""
    indexes = []
    deadline = time.monotonic() + timeout_s
    for rank in range(world_size):
        path = tmp / f"{shard_name(rank)}.json"
        while not path.is_file():
            if time.monotonic() > deadline:
                raise MeshtronError(f"checkpoint save of step {step}: rank {rank} did not write "
                                    f"its shard within {timeout_s:.0f} s")
            time.sleep(0.01)
        indexes.append(json.loads(path.read_text()))
    tensors, files, rng = merge_shard_indexes(indexes)
    for rank in range(world_size):
        files[f"{shard_name(rank)}.json"] = file_digest(tmp / f"{shard_name(rank)}.json")
    for filename, source in (copy_files or {}).items():
        shutil.copyfile(source, tmp / filename)
        fsync_file(tmp / filename)
        files[filename] = file_digest(tmp / filename)
    manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world_size,
                "files": files, "tensors": tensors, "rng": rng, **meta}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    fsync_file(tmp / MANIFEST)
    _fsync_dir(tmp)
    final = root / step_dir_name(step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    fsync_file(pointer)
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    for stale in root.glob(f".tmp-{final.name}-*"):  # an earlier, crashed attempt
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last > 0:
        _prune(root, keep_last)
    return final


def save_tensors(root: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                 copy_files: dict[str, Path] | None = None, keep_last: int = 0) -> Path:
    """One process: a complete checkpoint of whole global tensors (names as in the index)."""
    tmp = temp_dir(root, step, new_token())
    tmp.mkdir(parents=True)
    pieces = [Piece(name, tuple(t.shape), ((0,) * t.dim(), tuple(t.shape)), t.detach().cpu())
              for name, t in tensors.items()]
    write_shard(tmp, 0, pieces, torch.get_rng_state())
    return finalize_checkpoint(tmp, root, step, 1, meta, copy_files, keep_last)


def newest_step_dir(root: Path) -> Path | None:
    """The newest step directory under ``root`` by name (not verified), or None."""
    if not root.is_dir():
        return None
    named = sorted(p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir())
    return named[-1] if named else None


def _prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints, except the base models that kept
    adapter checkpoints adapt (their manifests' ``lora.path``)."""
    complete = sorted(p for p in root.iterdir() if STEP_DIR.match(p.name))
    bases = {base for kept in complete[-keep_last:] if (base := _adapted_base(kept))}
    for old in complete[:-keep_last]:
        if old.resolve() not in bases:
            shutil.rmtree(old, ignore_errors=True)


def _adapted_base(path: Path) -> Path | None:
    """The base checkpoint an adapter checkpoint names (None: none, or an unreadable
    manifest, which pruning leaves to the checks that read it)."""
    try:
        base = (json.loads((path / MANIFEST).read_text()).get("lora") or {}).get("path")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(base).resolve() if isinstance(base, str) else None


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check every file against its recorded checksum; return the manifest."""
    manifest = read_manifest(path)
    verify_files(path, manifest)
    return manifest


def open_checkpoint(path: Path) -> tuple[dict[str, Any], ShardReader]:
    """The manifest and a reader of its tensors (files are verified as they are opened)."""
    manifest = read_manifest(path)
    return manifest, ShardReader(path, manifest)


def find_latest(root: Path, warn: Callable[[str], None] | None = None,
                on_corrupt: str = "error", hint: str = ON_CORRUPT_HINT) -> Path | None:
    """The newest checkpoint under ``root`` (None when there is none); ``root`` may also be a
    checkpoint directory itself.

    Only a ``.tmp-*`` directory (a save that was interrupted) is skipped, through ``warn``: a
    step directory exists only complete, so one that is unusable was damaged afterwards, and
    the run stops with one line naming it. With ``on_corrupt="previous"`` every candidate's
    files are verified and unusable ones are skipped (through ``warn``) for an older one.
    Either way, when step directories exist but none is usable the answer is an error,
    never "no checkpoint" (which would train from scratch).
    """
    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=2))
    if (root / MANIFEST).is_file():
        read_manifest(root)
        return root
    if not root.is_dir():
        return None
    for leftover in sorted(root.glob(".tmp-step_*")):
        warn(f"ignoring {leftover}: a save that did not complete")
    candidates = sorted((p for p in root.iterdir() if STEP_DIR.match(p.name)), reverse=True)
    for candidate in candidates:
        try:
            if not candidate.is_dir():
                raise MeshtronError(f"{candidate} is a file named like a checkpoint directory")
            manifest = read_manifest(candidate)
            if on_corrupt == "previous":
                verify_files(candidate, manifest)
        except MeshtronError as err:
            if on_corrupt != "previous":
                raise MeshtronError(f"the newest checkpoint is unusable: {err}; move it away, "
                                    f"or {hint}") from None
            warn(f"skipping an unusable checkpoint: {err}")
            continue
        return candidate
    if candidates:
        raise MeshtronError(f"none of the {len(candidates)} checkpoints under {root} is usable "
                            "(each is named in a warning above)")
    return None
