"""Crash-safe checkpoint directories of safetensors files plus one JSON manifest.

Layout under a checkpoint root::

    step_00000100/            a complete checkpoint
        meta.json             manifest: step, config, sha256 of every file, user metadata
        model.safetensors ... tensors (never pickled)
    latest                    name of the newest complete checkpoint, updated last
    .tmp-step_00000200-1234/  a save in progress (or a crashed one): never loaded

A save writes everything into a temporary directory, fsyncs it, renames it into place and only
then updates ``latest``; a checkpoint whose manifest is missing or whose files fail their
checksum is skipped in favour of an older complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from meshtron.errors import MeshtronError

FORMAT_VERSION = 1
MANIFEST = "meta.json"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(
    root: Path,
    step: int,
    tensor_files: dict[str, dict[str, torch.Tensor]],
    meta: dict[str, Any],
    copy_files: dict[str, Path] | None = None,
    keep_last: int = 0,
) -> Path:
    """Write a complete checkpoint for ``step`` atomically; return its directory."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    checksums: dict[str, str] = {}
    for filename, tensors in tensor_files.items():
        path = tmp / filename
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
        checksums[filename] = _sha256(path)
    for filename, source in (copy_files or {}).items():
        shutil.copyfile(source, tmp / filename)
        checksums[filename] = _sha256(tmp / filename)
    manifest = {"format": FORMAT_VERSION, "step": step, "files": checksums, **meta}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for path in tmp.iterdir():
        _fsync_file(path)
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    _fsync_file(pointer)
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    if keep_last > 0:
        _prune(root, keep_last)
    return final


def _prune(root: Path, keep_last: int) -> None:
    complete = sorted(p for p in root.iterdir() if STEP_DIR.match(p.name))
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of one checkpoint directory, with a clear error when it is unusable."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise MeshtronError(f"checkpoint {path} is incomplete: {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise MeshtronError(f"checkpoint manifest {manifest_path} is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise MeshtronError(f"checkpoint {path} has an unknown format (expected {FORMAT_VERSION})")
    for filename in manifest.get("files", {}):
        if Path(filename).name != filename:
            raise MeshtronError(f"checkpoint {path} names a file outside itself: {filename!r}")
    return manifest


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check every file against its recorded sha256; return the manifest."""
    manifest = read_manifest(path)
    for filename, expected in manifest["files"].items():
        file = path / filename
        if not file.is_file():
            raise MeshtronError(f"checkpoint file {file} is missing")
        if _sha256(file) != expected:
            raise MeshtronError(f"checkpoint file {file} is corrupt (checksum mismatch)")
    return manifest


def load_tensors(path: Path, filename: str) -> dict[str, torch.Tensor]:
    file = path / filename
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise MeshtronError(f"checkpoint file {file} cannot be read: {err}") from None


def find_latest(root: Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete, verified checkpoint under ``root`` (None when there is none).

    ``root`` may also be a checkpoint directory itself. Incomplete or corrupt candidates are
    reported through ``warn`` and skipped.
    """
    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=2))
    if (root / MANIFEST).is_file():
        verify_checkpoint(root)
        return root
    if not root.is_dir():
        return None
    for leftover in root.glob(".tmp-step_*"):
        warn(f"ignoring half-written checkpoint {leftover}")
    candidates = sorted((p for p in root.iterdir() if STEP_DIR.match(p.name)), reverse=True)
    for candidate in candidates:
        try:
            verify_checkpoint(candidate)
        except MeshtronError as err:
            warn(f"skipping checkpoint: {err}")
            continue
        return candidate
    return None
