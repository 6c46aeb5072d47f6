"""A checkpoint's manifest (``meta.json``), checked against its schema before anything is used.

The manifest decides what is read and how much memory is allocated, so every field is
checked for its type and range, the step against the directory's name, and the bytes the
tensor index promises against the sizes of the files that must hold them: a hostile or
corrupt manifest (a shape of ``[10**12, 10**6]``, a step of ``"six"``, an RNG key pointing
into another file) is refused with one line before a tensor is allocated or a weight read.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from meshtron.checkpoint.digests import DIGEST, file_digest
from meshtron.checkpoint.shards import DTYPES, check_tensor_index
from meshtron.errors import MeshtronError

FORMAT_VERSION = 3
READ_FORMATS = (2, 3)
"""Format 3 records XXH3-128 checksums; format 2 (sha256) is still read."""
MANIFEST = "meta.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")
READABLE_FILES = re.compile(
    r"^(shard-\d{5}\.(safetensors|json)|tokenizer\.json|tokenizer_config\.json|chat_template\.jinja)$")
"""The files a checkpoint may list: shards, and the tokenizer with its config and chat template
(text read as JSON or rendered in jinja2's sandbox; never a pickled format)."""
MAX_STEP = 10**12


def _count(value: Any, minimum: int = 0) -> bool:
    return type(value) is int and minimum <= value <= MAX_STEP


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint directory ``path``, refused with one line naming what is
    wrong when it is missing, not JSON, of another format, or breaks the schema."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise MeshtronError(f"checkpoint {path} is incomplete: {MANIFEST} is missing")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise MeshtronError(f"checkpoint manifest {manifest_path} is not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READ_FORMATS:
        raise MeshtronError(f"checkpoint {path} has an unknown format (this version reads "
                            f"{' and '.join(map(str, READ_FORMATS))})")
    _check_files(path, manifest)
    _check_fields(path, manifest)
    check_tensor_index(path, manifest.get("tensors"), manifest["files"])
    _check_sizes(path, manifest)
    return manifest


def _check_files(path: Path, manifest: dict[str, Any]) -> None:
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise MeshtronError(f"checkpoint manifest {path / MANIFEST} lists no files")
    for filename, digest in files.items():
        if Path(filename).name != filename or ".." in filename:
            raise MeshtronError(f"checkpoint {path} names a file outside itself: {filename!r}")
        if not READABLE_FILES.match(filename):
            raise MeshtronError(
                f"checkpoint {path} lists {filename!r}: only shard-NNNNN.safetensors/.json, "
                "tokenizer.json, tokenizer_config.json and chat_template.jinja are read (never "
                "pickled formats)")
        if not isinstance(digest, str) or not DIGEST.match(digest):
            raise MeshtronError(f"checkpoint {path}: the checksum of {filename} is neither an "
                                "xxh3-128 nor a sha256 digest")


def _check_fields(path: Path, manifest: dict[str, Any]) -> None:
    """Step, world size, config, RNG keys and the training state's scalars."""
    step = manifest.get("step")
    if not _count(step):
        raise MeshtronError(f"checkpoint {path}: step must be a whole number in [0, "
                            f"{MAX_STEP}], got {step!r}")
    named = STEP_DIR.match(path.name)
    if named and int(named.group(1)) != step:
        raise MeshtronError(f"checkpoint {path} says it is step {step}, its directory says "
                            f"step {int(named.group(1))}")
    if not _count(manifest.get("world_size"), 1):
        raise MeshtronError(f"checkpoint {path}: world_size must be a positive whole number")
    if not isinstance(manifest.get("config", {}), dict):
        raise MeshtronError(f"checkpoint {path}: config must be a mapping")
    rng = manifest.get("rng", {})
    if not isinstance(rng, dict) or not all(
            isinstance(key, dict) and key.get("file") in manifest["files"]
            and isinstance(key.get("key"), str) and str(rank).isdigit()
            for rank, key in rng.items()):
        raise MeshtronError(f"checkpoint {path}: the RNG states must name a listed shard file "
                            "and key per rank")
    optimizer = manifest.get("optimizer", {})
    if not isinstance(optimizer, dict) or not _count(optimizer.get("steps", 0)):
        raise MeshtronError(f"checkpoint {path}: optimizer.steps must be a whole number >= 0")
    data = manifest.get("data", {})
    if not isinstance(data, dict) or not _count(data.get("next_batch", 0)) or \
            type(data.get("seed", 0)) is not int:
        raise MeshtronError(f"checkpoint {path}: data must hold a whole next_batch and seed")
    scale = manifest.get("loss_scale", [1.0, 0])
    if not (isinstance(scale, list) and len(scale) == 2 and type(scale[0]) in (int, float)
            and math.isfinite(scale[0]) and scale[0] > 0 and _count(scale[1])):
        raise MeshtronError(f"checkpoint {path}: loss_scale must be [a positive number, a "
                            "whole number of clean steps]")


def saved_config(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The config of the run that wrote the checkpoint (which builds its model)."""
    if "config" not in manifest:
        raise MeshtronError(f"checkpoint {path} holds no config (the settings of the run that "
                            "wrote it), so its model cannot be built")
    return manifest["config"]


def _check_sizes(path: Path, manifest: dict[str, Any]) -> None:
    """Each shard file is at least as large as the pieces the index places in it (a huge
    shape in the manifest is refused here, before anything is allocated)."""
    needed: dict[str, int] = {}
    for entry in manifest["tensors"].values():
        itemsize = DTYPES[entry["dtype"]].itemsize
        for piece in entry.get("pieces", []):
            needed[piece["file"]] = (needed.get(piece["file"], 0)
                                     + math.prod(piece["size"]) * itemsize)
    for filename, count in needed.items():
        file = path / filename
        if not file.is_file():
            raise MeshtronError(f"checkpoint file {file} is missing")
        if file.stat().st_size < count:
            raise MeshtronError(f"checkpoint {path}: the index places {count:,} bytes in "
                                f"{filename}, which holds {file.stat().st_size:,}")


def verify_files(path: Path, manifest: dict[str, Any]) -> None:
    """Check every listed file against its recorded checksum (a full read of the checkpoint)."""
    for filename, expected in manifest["files"].items():
        verify_file(path, manifest, filename, expected)


def verify_file(path: Path, manifest: dict[str, Any], filename: str,
                expected: str | None = None) -> Path:
    """``path/filename``, present and matching the checksum the manifest records for it."""
    file = path / filename
    expected = expected or manifest["files"].get(filename)
    if expected is None:
        raise MeshtronError(f"checkpoint {path} holds a {filename} its manifest does not list, "
                            "so it cannot be verified")
    if not file.is_file():
        raise MeshtronError(f"checkpoint file {file} is missing")
    if file_digest(file, expected) != expected:
        raise MeshtronError(f"checkpoint file {file} is corrupt (checksum mismatch)")
    return file
