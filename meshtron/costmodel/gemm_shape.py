"""How a GEMM's shape, not only its FLOPs, sets the fraction of peak it achieves on a GPU.

A GPU computes an (m, n) output in tiles, one tile per streaming multiprocessor (SM) at a time,
each tile running a main loop over the inner dimension k in steps of ``tile_k``. Two losses
follow from the shape alone (NVIDIA, "Matrix Multiplication Background User's Guide", sections
"Dimension Quantization Effects": tile quantization and wave quantization):

- **Tile and wave quantization.** ``ceil(m/tile_m) * ceil(n/tile_n)`` tiles run in waves of
  ``sm_count``; a partial last tile or a partial last wave costs as much as a full one. The
  library picks its tile per shape, so the best of a few is taken.
- **The epilogue.** After its k loop a tile converts its fp32 accumulators and writes its
  ``tile_m * tile_n`` outputs to memory. While every SM writes at the end of a wave they share
  the memory's bandwidth, so the epilogue costs ``out_bytes * peak / (2 * bandwidth * tile_k)``
  k steps of the main loop, amortised over ``k / tile_k`` steps: 4.6 steps on an H100 SXM (989
  TFLOP/s, 3.35 TB/s, bf16 output), so a k of 2,048 (32 steps) loses 13% where 8,192 loses 3.5%.
  This is the arithmetic-intensity argument of the same guide applied to the output alone (the
  inputs stream in behind the math, CUTLASS's multistage pipelines); it is a bound, since tiles
  of a persistent kernel drift apart and overlap one's epilogue with another's math.

The profile's efficiency curve (``gemm_efficiency``) gives the fraction by FLOPs, as benchmarks
of square GEMMs report it; :func:`shape_factor` scales it by the shape's losses over those of
the square GEMM of the same FLOPs (no quantization, k = its side). Nothing here is fitted to
measured training runs: the SM count, tile and memory bandwidth are data-sheet and kernel
figures, and a calibrated profile's curve is measured with the same factor divided out.
"""

from __future__ import annotations

import math

OUTPUT_BYTES = 2
"""Bytes of one output element: bf16/fp16 products (fp8 ones too) write 16-bit results."""


SQUARE_TILE = (128, 128)
"""The smaller tile cuBLAS also ships on both generations (``ampere_bf16_s16816gemm_bf16_128x128
_ldg8_f2f_stages_64x3``, ``sm90_xmma_gemm_..._tilesize128x128x64``): its heuristics take it where
the large tile's last wave would run part empty."""


def quantization(m: float, n: float, sm_count: int, tile_m: int, tile_n: int) -> float:
    """Useful outputs over the outputs the waves of tiles compute, for the best of the
    ``tile_m x tile_n`` tile, its transpose and :data:`SQUARE_TILE` (cuBLAS picks among
    them); every tile is taken to run its main loop at the same rate."""
    best = 0.0
    for tm, tn in ((tile_m, tile_n), (tile_n, tile_m), SQUARE_TILE):
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sm_count)
        best = max(best, m * n / (waves * sm_count * tm * tn))
    return best


def epilogue_steps(peak: float, bandwidth: float, tile_k: int) -> float:
    """Main-loop k steps one tile's epilogue takes: its outputs' bytes at the SM's share of the
    memory bandwidth over one k step's FLOPs at the SM's share of the peak (the tile's area
    cancels)."""
    return OUTPUT_BYTES * peak / (2.0 * bandwidth * tile_k)


def k_efficiency(k: float, tile_k: int, overhead: float) -> float:
    """The main loop's share of a tile's time: ``k`` in whole steps, plus the epilogue."""
    steps = math.ceil(k / tile_k)
    return k / (tile_k * (steps + overhead))


def shape_factor(m: float, n: float, k: float, sm_count: int, tile: tuple[int, int, int],
                 peak: float, bandwidth: float) -> float:
    """The (m, n, k) GEMM's efficiency over that of the square GEMM of the same FLOPs."""
    tile_m, tile_n, tile_k = tile
    overhead = epilogue_steps(peak, bandwidth, tile_k)
    side = (m * n * k) ** (1 / 3)
    square = side / (side + tile_k * overhead)
    return (quantization(m, n, sm_count, tile_m, tile_n)
            * k_efficiency(k, tile_k, overhead) / square)
