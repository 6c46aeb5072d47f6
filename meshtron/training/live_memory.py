"""Memory measured from the tensors that exist, not from anyone's accounting.

:class:`LiveTensorBytes` watches every operator while it is active and keeps a weak reference to
each storage an operator creates (views and in-place results share their input's storage and
are not new), so at any moment it can say how many bytes of what it saw created are still
alive, and the most there ever were. It sees what autograd saves, what a weight-gradient store
defers, received messages and gradient buffers alike, which is what makes it a check on the
formulas of :mod:`meshtron.training.memory` and on the optimizer's ``memory_bytes()``.

:func:`reachable_storage_bytes` counts, instead, the storages reachable from some objects (a
model, an optimizer): what they keep between steps.
"""

from __future__ import annotations

import gc
import types
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes() as live:`` ... ``live.bytes()``, ``live.peak``.

    ``peak`` is sampled after every operator, so it is the true high-water mark of storages
    created inside the block (those created before it are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {s._cdata for s in _storages((args, kwargs))}
        for storage in _storages(out):
            key = storage._cdata
            if key not in inputs and key not in self._live:
                self._live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.bytes())
        return out

    def bytes(self) -> int:
        """Bytes of the storages created so far that are still alive."""
        dead = [key for key, (ref, _) in self._live.items() if ref.expired()]
        for key in dead:
            del self._live[key]
        return sum(size for _, size in self._live.values())


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType,
           types.BuiltinFunctionType)
"""Not followed: they lead to module globals, i.e. to everything."""


def reachable_storage_bytes(*roots: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``roots`` through containers and
    object attributes (parameters' ``.grad`` included)."""
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or isinstance(obj, _OPAQUE):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr() or id(storage)] = storage.nbytes()
            if obj.grad is not None:
                stack.append(obj.grad)
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())
