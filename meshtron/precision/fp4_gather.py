"""The NVFP4 parameter all-gather's arithmetic on one rank's part of a weight.

ZeRO-3 cuts a bucket's flat buffer into equal shards, so a rank holds a run of a weight's
elements in row-major order that may start and end anywhere: inside a row, inside a 16 x 16
tile. NVFP4 scales each weight tile (2-D scaling) under one per-tensor scale, so a tile's
scale needs the amax of elements other ranks hold. Here a run is placed in a window of whole
tile rows (zeros elsewhere, which no amax notices) so that the very functions one process
quantises a whole weight with work on it: :func:`run_tile_amax` gives the amax of each tile
over the elements held (zero where none), which one all-reduce (max) over the shard group
turns into the whole tiles' amaxes; :func:`encode_run` gives the run's E2M1 codes at the
agreed scales, element by element as in the whole weight. The codes travel two to a byte
(:func:`pack_nibbles`: the even element in the low nibble), a run of odd length padded with one
zero nibble.
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshtron.precision.fp8 import tile_amax
from meshtron.precision.nvfp4 import NVFP4_BLOCK, WEIGHT_TILE, nvfp4_encode


def _window(run: Tensor, first: int, shape: torch.Size) -> tuple[Tensor, int, int]:
    """The run (elements ``first..`` of a [rows, cols] weight, flattened) in fp32 inside a
    zero window of whole tile rows; returns the window [k x 16, cols], its first tile row and
    where the run starts in it."""
    cols = shape[1]
    top = first // cols // NVFP4_BLOCK
    bottom = -(-((first + run.numel() - 1) // cols + 1) // NVFP4_BLOCK)
    window = torch.zeros((bottom - top) * NVFP4_BLOCK * cols, dtype=torch.float32,
                         device=run.device)
    at = first - top * NVFP4_BLOCK * cols
    window[at : at + run.numel()] = run.detach().float()
    return window.view(-1, cols), top, at


def run_tile_amax(run: Tensor, first: int, shape: torch.Size) -> Tensor:
    """The amax of each 16 x 16 tile of a [rows, cols] weight over the elements of ``run``
    (elements ``first..`` of the flattened weight); 0 in tiles the run does not touch."""
    window, top, _ = _window(run, first, shape)
    out = torch.zeros(shape[0] // NVFP4_BLOCK, shape[1] // NVFP4_BLOCK, dtype=torch.float32,
                      device=run.device)
    part = tile_amax(window, WEIGHT_TILE)
    out[top : top + part.shape[0]] = part
    return out


def encode_run(run: Tensor, first: int, shape: torch.Size, scale8: Tensor,
               tensor_scale: Tensor) -> Tensor:
    """The E2M1 codes (uint8, one per element) of ``run`` at the whole weight's tile scales
    ``scale8`` [rows / 16, cols / 16] and per-tensor scale."""
    window, top, at = _window(run, first, shape)
    rows = window.shape[0] // NVFP4_BLOCK
    codes = nvfp4_encode(window, scale8[top : top + rows], tensor_scale, WEIGHT_TILE).codes
    return codes.reshape(-1)[at : at + run.numel()]


def pack_nibbles(codes: Tensor) -> Tensor:
    """4-bit codes (uint8 [n]) two to a byte ([ceil(n / 2)]): element 2i in the low nibble,
    2i + 1 in the high one (a zero nibble after an odd last element)."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    return codes[0::2] | (codes[1::2] << 4)


def unpack_nibbles(data: Tensor, n: int) -> Tensor:
    """The ``n`` codes :func:`pack_nibbles` packed into ``data``."""
    return torch.stack([data & 0xF, data >> 4], dim=1).reshape(-1)[:n]


def packed_size(n: int) -> int:
    """Bytes of ``n`` packed codes."""
    return (n + 1) // 2
