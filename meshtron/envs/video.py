"""Rollouts as animated GIFs a person can watch: frames upscaled with nearest-neighbour pixels
(a 32x32 observation becomes 256x256 with crisp edges), looped, with a progress bar beneath.

The bar shows how far into the episode a frame is; it also makes every frame differ from the
one before, which keeps one GIF frame per given frame (Pillow folds repeated frames into one).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from meshtron.errors import MeshtronError

TARGET_PIXELS = 256


BAR_RGB, BAR_BACKGROUND = (200, 200, 200), (20, 20, 20)


def upscale(frame: np.ndarray, scale: int) -> np.ndarray:
    return np.repeat(np.repeat(frame, scale, axis=0), scale, axis=1)


def with_progress(frame: np.ndarray, done: int, total: int) -> np.ndarray:
    """``frame`` above a bar filled to ``done / total`` of its width."""
    height, width = max(3, frame.shape[0] // 48), frame.shape[1]
    bar = np.empty((height, width, 3), dtype=np.uint8)
    bar[:] = BAR_BACKGROUND
    bar[:, : round(width * done / total)] = BAR_RGB
    return np.concatenate([frame, bar], axis=0)


def save_gif(frames: Sequence[np.ndarray], path: str | Path, *, fps: float = 4.0,
             scale: int | None = None) -> Path:
    """Write ``frames`` (uint8 [H, W, 3] each, all one shape) to ``path`` as a looping GIF, each
    frame upscaled ``scale`` times (default: to about 256 pixels across). Returns the path."""
    if len(frames) == 0:
        raise MeshtronError("no frames to write to a GIF")
    first = np.asarray(frames[0])
    if first.dtype != np.uint8 or first.ndim != 3 or first.shape[2] != 3:
        raise MeshtronError(f"GIF frames must be uint8 [H, W, 3] images, not {first.dtype} "
                            f"{list(first.shape)}")
    if any(np.shape(f) != first.shape for f in frames):
        raise MeshtronError("GIF frames must all have the same shape")
    if fps <= 0:
        raise MeshtronError(f"fps must be positive, not {fps}")
    scale = scale or max(1, TARGET_PIXELS // max(first.shape[:2]))
    images = [Image.fromarray(with_progress(upscale(np.asarray(f), scale), i + 1, len(frames)))
              for i, f in enumerate(frames)]
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        images[0].save(path, format="GIF", save_all=True, append_images=images[1:],
                       duration=round(1000 / fps), loop=0)
    except OSError as err:
        raise MeshtronError(f"cannot write the GIF {path} ({err.strerror or err})") from None
    return path
