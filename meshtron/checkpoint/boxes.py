"""Geometry of checkpoint pieces: which box of a global tensor a rank's data covers.

A *box* is an (offset, size) pair of equal-length tuples: the elements
``global[o0:o0+s0, o1:o1+s1, ...]``. Every piece of data in a checkpoint is one box of one global
tensor, whatever layout wrote it; a rank loading under another layout asks for its own boxes
and copies the overlaps.

Two things produce boxes: tensor parallelism (a :class:`SliceSpec` takes ``parts`` blocks along
one dimension, so a tp-local tensor is one box per part) and ZeRO (a rank holds a flat range of
a tp-local tensor's row-major elements, which is a few boxes: a partial first row, whole rows,
a partial last row, recursively).
"""

from __future__ import annotations

import math

from meshtron.parallel.mesh.params import SliceSpec

Box = tuple[tuple[int, ...], tuple[int, ...]]


def volume(box: Box) -> int:
    return math.prod(box[1])


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The boxes of a tensor of ``shape`` whose row-major elements start..end-1 they cover."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner

    def row(r: int, lo: int, hi: int) -> list[Box]:
        return [((r, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        return row(first, start - first * inner, end - first * inner)
    boxes: list[Box] = []
    full_from = first
    if start % inner:
        boxes += row(first, start % inner, inner)
        full_from = first + 1
    full_to = last + 1 if end % inner == 0 else last
    if full_to > full_from:
        boxes.append(((full_from, *(0,) * (len(shape) - 1)), (full_to - full_from, *shape[1:])))
    if end % inner:
        boxes += row(last, 0, end % inner)
    return boxes


def local_to_global(box: Box, spec: SliceSpec | None,
                    global_shape: tuple[int, ...]) -> list[tuple[Box, Box]]:
    """Map a box of a tp-local tensor to (local box, global box) pairs, split where the local
    tensor's ``parts`` blocks meet."""
    if spec is None:
        return [(box, box)]
    offset, size = box
    dim = spec.dim
    global_block = global_shape[dim] // spec.parts
    local_block = global_block // spec.count
    out = []
    lo, hi = offset[dim], offset[dim] + size[dim]
    for part in range(spec.parts):
        p_lo, p_hi = max(lo, part * local_block), min(hi, (part + 1) * local_block)
        if p_lo >= p_hi:
            continue
        shift = part * global_block + spec.index * local_block - part * local_block
        local_off = offset[:dim] + (p_lo,) + offset[dim + 1:]
        global_off = offset[:dim] + (p_lo + shift,) + offset[dim + 1:]
        sub_size = size[:dim] + (p_hi - p_lo,) + size[dim + 1:]
        out.append(((local_off, sub_size), (global_off, sub_size)))
    return out


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b`` (global coordinates), or None."""
    offset, size = [], []
    for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if lo >= hi:
            return None
        offset.append(lo)
        size.append(hi - lo)
    return tuple(offset), tuple(size)


def slices(box: Box, origin: tuple[int, ...] | None = None) -> tuple[slice, ...]:
    """Index of ``box`` inside a tensor whose element 0 sits at ``origin`` (default: 0)."""
    origin = origin or (0,) * len(box[0])
    return tuple(slice(o - base, o - base + s) for o, s, base in zip(box[0], box[1], origin))
