"""The parameters of one gradient bucket as a flat buffer, of which each dp rank owns a shard.

Under ZeRO-1/2 the full buffer persists and the parameters are views into it; after the
optimizer updates this rank's shard, an all-gather refreshes the rest. Under ZeRO-3 only the
shard persists: the full buffer is gathered just before its parameters are used and freed
after, and the parameters point at an empty tensor in between.

Freeing empties the full buffer's storage (``resize_(0)``) rather than dropping the tensor, and
the next gather refills that same storage, as FSDP2 does: a layer may save for backward a view
of its weight (a slice, a transpose), and such a view would otherwise keep the whole unit's
gathered buffer alive from its forward to its backward, next to the copy gathered again for
the backward. The refill writes through a detached alias (``.data``), so autograd's version
counter of those saved views does not change: their values are the same as at forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtron.optim.fp8_gather import FP8Gather
from meshtron.optim.grad_buckets import Bucket
from meshtron.parallel.tensor.collectives import start_all_gather


class FlatParams:
    def __init__(self, bucket: Bucket, sharded: bool, whole: bool = False):
        """``whole``: every rank owns the whole buffer (ZeRO-0 with fp32 master weights)."""
        self.bucket = bucket
        self.group = bucket.group
        self.sharded = sharded
        self.whole = whole
        first = bucket.params[0]
        full = torch.zeros(bucket.padded, dtype=first.dtype, device=first.device)
        for i, param in enumerate(bucket.params):
            bucket.view(full, i).copy_(param.data)
        self.start, self.end = (0, bucket.padded) if whole else bucket.shard_range()
        self.full: torch.Tensor | None = None
        self.work: dist.Work | None = None
        self.fp8: FP8Gather | None = None
        """ZeRO-3 with ``precision.fp8_param_gather``: gathers go through this packing."""
        self._gathered: torch.Tensor | None = None
        if sharded:
            self.shard = full[self.start : self.end].clone()
            self.buffer = full
            """The full buffer, its storage emptied while the parameters are not gathered."""
            self.free()
        else:
            self.full = full
            self.shard = full[self.start : self.end]
            self._point_params()

    def _point_params(self) -> None:
        for i, param in enumerate(self.bucket.params):
            param.data = self.bucket.view(self.full, i)

    def start_gather(self) -> None:
        """Begin rebuilding the full buffer from every rank's shard (ZeRO-3)."""
        if self.full is not None or self.work is not None:
            return
        storage = self.buffer.untyped_storage()
        storage.resize_(self.bucket.padded * self.buffer.element_size())
        full = self.buffer.data  # an alias with its own version counter (see the module)
        if self.fp8 is None:
            full[self.start : self.end].copy_(self.shard)
            self.work = start_all_gather(full, self.group)
        else:  # FP8 bytes (and the rest's own bytes) in, unpacked in wait_gather
            self._gathered = self.fp8.gather_buffer(self.shard, self.start)
            self.work = start_all_gather(self._gathered, self.group)
        self._pending = full

    def wait_gather(self) -> None:
        """Finish :meth:`start_gather` (starting it if needed); parameters become usable."""
        if self.full is not None:
            return
        self.start_gather()
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self._gathered is not None:
            self.fp8.unpack(self._gathered, self._pending)
            self._gathered = None
        self.full, self._pending = self._pending, None
        self._point_params()

    def free(self) -> None:
        """Drop the full buffer and any gather in flight; parameters keep their identity but
        hold no data (ZeRO-3)."""
        if self.work is not None:
            self.work.wait()
            self.work = self._pending = None
        self._gathered = None
        empty = torch.empty(0, dtype=self.shard.dtype, device=self.shard.device)
        for param in self.bucket.params:
            param.data = empty
        self.buffer.untyped_storage().resize_(0)
        self.full = None

    def after_update(self) -> dist.Work | None:
        """The shard changed: refresh the full buffer everywhere (ZeRO-1/2; a no-op for 3)."""
        if self.sharded or self.whole:
            return None
        return start_all_gather(self.full, self.group)

    def nbytes(self) -> int:
        """Bytes kept between steps: the full buffer (ZeRO-1/2) or only the shard (ZeRO-3)."""
        kept = self.shard if self.sharded else self.full
        return kept.numel() * kept.element_size()
