"""Writing checkpoints, synchronously or in the background (``checkpoint.async``).

A save starts from this rank's pieces (``train_state.capture``: host copies for a background
save, the host tensors themselves for a synchronous one). The shard file, its index and, on
the first rank, the manifest, the rename and the ``latest`` pointer are then written either
at once or by one background thread while training goes on. A background save can also take
the capture itself: its thread copies the state while the next step's forward and backward
run, and :meth:`CheckpointSaver.wait_captured` (the optimizer's update fence) holds the update
back until the copy is done, so training stalls only for what the copy did not overlap.

At most one save is in flight: a new save, :meth:`check` (called every step) and :meth:`wait`
surface an earlier failure as a :class:`MeshtronError`. The background thread uses no
collectives: ranks meet through the files in the temporary directory.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from meshtron.checkpoint.shards import Piece, write_shard
from meshtron.checkpoint.store import finalize_checkpoint, newest_step_dir, step_dir_name, temp_dir
from meshtron.errors import MeshtronError
from meshtron.files import os_reason


class CheckpointSaver:
    def __init__(self, root: Path, rank: int, world_size: int, token: str, *,
                 keep_last: int, asynchronous: bool, timeout_s: float = 600.0,
                 after_shard: Callable[[int], None] | None = None):
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.token = token
        self.keep_last = keep_last
        self.timeout_s = timeout_s
        self.after_shard = after_shard
        """Called with the step once this rank's shard is written (fault injection)."""
        self.executor = ThreadPoolExecutor(1, "checkpoint") if asynchronous else None
        self.pending: tuple[int, Future] | None = None
        self.captured = threading.Event()
        self.captured.set()
        self.buffers: dict[tuple, torch.Tensor] = {}
        """Host copies of the state, reused by every save (see ``train_state.capture``)."""

    def save(self, step: int, pieces: list[Piece] | Callable[[], list[Piece]],
             meta: dict[str, Any], copy_files: dict[str, Path]) -> Path:
        """Write (or start writing) checkpoint ``step``; ``meta`` and ``copy_files`` are used
        by the first rank only. ``pieces`` may be the function that captures them, which a
        background save calls on its own thread (see :meth:`wait_captured`). Returns where the
        checkpoint will be."""
        self.wait()
        tmp = temp_dir(self.root, step, self.token)
        tmp.mkdir(parents=True, exist_ok=True)
        rng = torch.get_rng_state()
        if self.executor is None:
            try:
                self._write(tmp, step, pieces() if callable(pieces) else pieces, rng, meta,
                            copy_files)
            except (OSError, SafetensorError) as err:
                raise self._failed(step, tmp, err) from None
        else:
            self.captured = threading.Event()
            self.pending = (step, self.executor.submit(self._capture_and_write, tmp, step,
                                                       pieces, rng, meta, copy_files))
        return self.root / step_dir_name(step)

    def wait_captured(self) -> None:
        """Block until the background save in flight holds its own copy of the state (at
        once when it was given pieces, or when nothing is in flight)."""
        self.captured.wait()

    def _capture_and_write(self, tmp: Path, step: int,
                           pieces: list[Piece] | Callable[[], list[Piece]], rng: torch.Tensor,
                           meta: dict[str, Any], copy_files: dict[str, Path]) -> None:
        try:
            if callable(pieces):
                pieces = pieces()
        except BaseException:  # raised by check() or wait(); nothing half-written is left
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            self.captured.set()
        self._write(tmp, step, pieces, rng, meta, copy_files)

    def _write(self, tmp: Path, step: int, pieces: list[Piece], rng: torch.Tensor,
               meta: dict[str, Any], copy_files: dict[str, Path]) -> None:
        write_shard(tmp, self.rank, pieces, rng)
        if self.after_shard is not None:
            self.after_shard(step)
        if self.rank == 0:
            finalize_checkpoint(tmp, self.root, step, self.world_size, meta, copy_files,
                                self.keep_last, self.timeout_s)

    def check(self) -> None:
        """Raise the error of a background save that has failed (without waiting)."""
        if self.pending is not None and self.pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight is written; raise its error if it failed."""
        if self.pending is None:
            return
        step, future = self.pending
        self.pending = None
        try:
            future.result()
        except MeshtronError:
            raise
        except Exception as err:  # noqa: BLE001 - an I/O error of the writer thread
            raise self._failed(step, temp_dir(self.root, step, self.token), err) from None

    def _failed(self, step: int, tmp: Path, err: BaseException) -> MeshtronError:
        """One line for a save the file system refused, saying what is kept; the half-written
        directory is removed (it would only fill the disk further)."""
        shutil.rmtree(tmp, ignore_errors=True)
        code = re.search(r"os error (\d+)", str(err))  # how safetensors reports an OSError
        if isinstance(err, OSError) or code:
            number = err.errno if isinstance(err, OSError) else int(code.group(1))
            reason = os_reason(OSError(number, os.strerror(number or 0)))
        else:
            reason = str(err).strip().splitlines()[0][:160]
        kept = newest_step_dir(self.root)
        return MeshtronError(
            f"saving the checkpoint of step {step} under {self.root} failed ({reason}); "
            + (f"the newest complete checkpoint, {kept}, is kept" if kept else
               "there is no earlier checkpoint"))

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self.executor is not None:
                self.executor.shutdown()
