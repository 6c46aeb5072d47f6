"""``meshtron convert`` with GGUF files on either side; everything else goes to
:func:`.hf_convert.convert`.

Kept apart from :mod:`.hf_convert` so that Hugging Face conversions never import the ``gguf``
package, and so the GGUF modules can build on the HF import and export without a cycle.
"""

from __future__ import annotations

from pathlib import Path

from meshtron.checkpoint import hf_convert
from meshtron.checkpoint.gguf_export import GGUF_TYPES, export_gguf
from meshtron.checkpoint.gguf_file import is_gguf
from meshtron.checkpoint.gguf_import import import_gguf
from meshtron.checkpoint.hf_convert import Conversion
from meshtron.checkpoint.loading import resolve_checkpoint
from meshtron.errors import MeshtronError

FORMATS = (*hf_convert.FORMATS, "gguf")


def convert(src: Path, dst: Path, fmt: str = "meshtron",
            gguf_type: str | None = None) -> Conversion:
    """Convert the model at ``src`` (a GGUF file, an HF folder or a meshtron run/checkpoint,
    detected) to ``fmt`` (``meshtron``, ``hf`` or ``gguf``) at ``dst``."""
    if fmt not in FORMATS:
        raise MeshtronError(f"--format must be one of {', '.join(FORMATS)}, got '{fmt}'")
    if gguf_type is not None and fmt != "gguf":
        raise MeshtronError("--gguf-type applies only to --format gguf")
    if is_gguf(src):
        if fmt != "meshtron":
            raise MeshtronError(f"{src} is a GGUF file, which converts only to a meshtron "
                                "checkpoint (--format meshtron)")
        if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
            raise MeshtronError(f"destination {dst} exists and is not empty")
        return import_gguf(src, dst)
    if fmt != "gguf":
        return hf_convert.convert(src, dst, fmt)
    if hf_convert.detect_source(src) != "meshtron":
        raise MeshtronError(f"{src} is a Hugging Face folder; --format gguf writes a meshtron "
                            "run or checkpoint (import the folder with meshtron convert first)")
    if dst.exists() or dst.is_symlink():
        raise MeshtronError(f"destination {dst} exists; --to names the new .gguf file")
    return export_gguf(resolve_checkpoint(src), dst, gguf_type or "f32")


__all__ = ["FORMATS", "GGUF_TYPES", "convert", "export_gguf", "import_gguf"]
