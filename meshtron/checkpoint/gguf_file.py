"""Reading a GGUF file (llama.cpp's format) through the ``gguf`` package: its metadata as plain
Python values and its tensors dequantised to fp32.

Everything about the format itself, the header, the metadata types, the block layouts of the
quantised types and their dequantisation, is the ``gguf`` package's (``GGUFReader``,
``gguf.quants``; its metadata arrays read a block at a time, :mod:`.gguf_fields`): this
module only turns its failures into one line. A truncated or damaged file fails while the
reader maps it (each tensor's bytes are checked against the file's end there), so nothing is
dequantised from a file that is not whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from meshtron.checkpoint.gguf_fields import FastReader
from meshtron.errors import MeshtronError

MAGIC = b"GGUF"


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that claims to be GGUF (by its suffix or its magic bytes)."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file: its name, type and shape in PyTorch order (rows first)."""

    name: str
    type_name: str
    shape: tuple[int, ...]


class GGUFModel:
    """An opened GGUF file: ``metadata`` (key -> value), the tensors' descriptions, and
    :meth:`tensor` to dequantise one of them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            reader = FastReader(str(path))
        except OSError as err:
            raise MeshtronError(f"cannot read {path} ({err.strerror or err})") from None
        except Exception as err:  # the reader raises ValueError, IndexError, ... on bad bytes
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise MeshtronError(f"{path} is not a readable GGUF file (truncated or damaged: "
                                f"{why})") from None
        self._reader = reader
        self.metadata = {key: _field_value(field) for key, field in reader.fields.items()}
        self._tensors = {t.name: t for t in reader.tensors}
        self.tensors = {t.name: GGUFTensorInfo(t.name, t.tensor_type.name,
                                               tuple(int(n) for n in reversed(t.shape.tolist())))
                        for t in reader.tensors}

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name``, dequantised to fp32 by ``gguf.quants`` (a copy, not a view of
        the mapped file)."""
        t = self._tensors[name]
        try:
            # a plain view of the mapped bytes: gguf.quants splits its input into row
            # groups, and each slice of a memmap runs memmap's Python-level hooks
            values = gguf.quants.dequantize(t.data.view(np.ndarray), t.tensor_type)
        except NotImplementedError:
            raise MeshtronError(unsupported_type(self.path, name, t.tensor_type.name)) from None
        array = np.array(values, dtype=np.float32).reshape(self.tensors[name].shape)
        if not np.isfinite(array).all():  # numpy's check: a tenth of torch's time on 2 cores
            raise MeshtronError(f"tensor '{name}' in {self.path} holds NaN or infinite values; "
                                "refusing to import it")
        return torch.from_numpy(array)

    def check_types(self, names: list[str]) -> None:
        """Refuse, before anything is dequantised, a tensor whose type ``gguf.quants`` cannot
        dequantise (one zero block of each type is tried)."""
        tried: dict[str, bool] = {}
        for name in names:
            qtype = self._tensors[name].tensor_type
            if qtype.name not in tried:
                tried[qtype.name] = _dequantizable(qtype)
            if not tried[qtype.name]:
                raise MeshtronError(unsupported_type(self.path, name, qtype.name))


def unsupported_type(path: Path, name: str, type_name: str) -> str:
    return (f"tensor '{name}' in {path} has type {type_name}, which cannot be dequantised "
            f"(supported: {', '.join(supported_types())})")


def supported_types() -> list[str]:
    """The tensor types ``gguf.quants`` dequantises, by name."""
    return [q.name for q in gguf.GGMLQuantizationType if _dequantizable(q)]


def _dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError):
        return False  # integer types, F64 and blocks gguf.quants has no dequantiser for
    return True


def _field_value(field: Any) -> Any:
    """A metadata value as Python: a str, int, float or bool, or a list of them. A float32 is
    read as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06): the value the
    file was written from."""
    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        return float(str(np.float32(value)))
    return value
