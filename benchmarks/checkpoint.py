"""Checkpoints: meshtron's sharded save and load against ``torch.distributed.checkpoint`` (DCP).

Run from the repository root::

    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint.py [--rounds R] [--json OUT]

(``--layers``, ``--dir``, ``--overlap-steps``, ``--configs NAME ...``, ``--timeout``: see
``--help``.)

**What runs.** Every configuration holds the same training state: meshtron's ``Transformer`` of
the ``small`` preset shape with ``--layers`` 2 layers (llama: hidden 768, 12 heads, ffn 2048,
vocab 32000, untied output; 63.3M parameters), fp32, seeded ``initialize`` (seed 0), then two
real training steps (seq 64, one row per rank, lr 1e-4, clipping at 1.0, AdamW with meshtron's
parameter groups) so that AdamW's moments exist: 760 MB of tensor data (parameters,
``exp_avg``, ``exp_avg_sq``). The model and optimizer loaded into are built the same way with
seed 1, so a load visibly changes them. Processes are spawned with gloo over a ``file://``
rendezvous, one torch thread each; dp=2 configurations run in two processes, the others in one:

- ``meshtron dp=2 zero=1``: ``DataParallelOptimizer(zero=1)`` (ZeRO-1: each rank holds half of
  the AdamW moments) and ``train_step``. Saving: ``train_state.capture`` (host copies of this
  rank's pieces), ``CheckpointSaver.save`` (``safetensors`` shard, fsync, sha256, shard index;
  rank 0 then waits for every index and writes the manifest, renames the directory and points
  ``latest`` at it), then a barrier (as the trainer does). Rank 0 writes the parameters and its
  half of the moments, rank 1 its half. Loading: ``open_checkpoint`` + ``train_state.restore``
  into a freshly built model and optimizer: every rank reads only the slices it holds (all
  parameters, its half of the moments) and verifies the sha256 of every file it opens.
- ``meshtron dp=2 zero=0``: the same with replicated AdamW state (``torch.optim.AdamW``); rank 0
  writes everything, and each rank reads everything back.
- ``DCP dp=2 (DDP)``: the same ``Transformer`` on a one-process mesh wrapped in
  ``DistributedDataParallel``, ``torch.optim.AdamW`` (``build_adamw``), a plain training step
  (local mean loss, backward, ``clip_grad_norm_``, step). Saving: ``get_state_dict(ddp, optim)``
  and ``dcp.save({"model", "optim"}, checkpoint_id=dir)`` (``FileSystemWriter`` defaults: one
  file per rank, one I/O thread, fsync); DCP's planner writes each replicated tensor once,
  spreading them over the ranks. Loading: ``get_state_dict`` of a fresh DDP model and
  optimizer, ``dcp.load``, ``set_state_dict``; each rank reads the whole state. DCP runs on its
  own gloo group, so that its background collectives never meet DDP's.
- ``meshtron 1 proc`` and ``DCP 1 proc``: the same on one process (no DDP).

Both fresh (load-target) optimizers get their state allocated before anything is timed
(meshtron ``init_state``, DCP an untimed ``get_state_dict``, which runs its zero-lr step), so a
load time is reading, checking and copying only. After the first load, the fresh model and
optimizer must equal the saved ones exactly (every parameter, moment and step count: checked
and printed; for DCP every leaf of ``get_state_dict``).

**How it is timed** (every timed phase starts after a barrier; a time is the slowest rank's):

- *sync save*: ``capture`` + ``save`` + barrier (meshtron), ``get_state_dict`` + ``dcp.save``
  (DCP), until every rank has passed the barrier after it: the checkpoint is complete on disk.
- *cold load*: rank 0 first fsyncs every file of the checkpoint and drops it from the page
  cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (only these files; the residue is checked
  with ``fincore`` when installed and printed). Then open/``restore`` (meshtron) or
  ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` (DCP) into the fresh model. The disk is
  a virtual one: the host may still cache it.
- *warm load*: the same load again, the files now in the page cache.
- *sha256* (meshtron): afterwards, ``meshtron.checkpoint.shards.sha256`` of the files this
  rank's load opened, timed separately (warm): the checksum part of a warm load.
- *async save*: ``capture`` + ``save`` on an asynchronous ``CheckpointSaver`` (meshtron), or
  ``get_state_dict`` + ``dcp.async_save`` (DCP; its default stager copies the state into newly
  allocated host memory, then a thread writes): the **stall** is the time until the call
  returns control to the training loop (per rank, no barrier). Training steps then run while
  the write goes on (at most ``--overlap-steps``, default 1; after each step the ranks agree
  whether every rank's save is done); their time against the second set-up step (no save in
  flight) shows what the background write costs the steps on these shared cores. *write*: from
  the call until the save's future completes (a done-callback's ``perf_counter``; on meshtron's
  rank 0 that includes the manifest and rename). *total*: until every rank is past
  ``wait`` / ``future.result()`` and a barrier, so at least the overlapping step. *reuse*
  (meshtron): afterwards, the same pieces copied once more into the capture's buffers, which
  are now in memory: what a capture that kept its buffers between saves would cost (a fresh
  buffer costs page faults on first touch). In the first round the async checkpoint is also
  loaded and compared with a snapshot taken just before the save, which proves the training
  steps during the write did not leak into it.

MB = 10^6 bytes of tensor data in the checkpoint, from the checkpoint's own index (meshtron's
manifest, DCP's ``.metadata``); throughput = that / the time. Files and bytes written per rank
are printed beside it. ``--rounds`` rounds run every configuration once in fresh processes, in
an order rotating every round (the one-process and the two-process group alternate too); all
figures are medians over rounds, and the round ratio is the median over rounds of the
per-round ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import spawn

SEQ = 64
VOCAB = 32000
LR = 1e-4
MB = 1e6


@dataclass(frozen=True)
class Setup:
    name: str
    family: str
    """meshtron or dcp."""
    world: int
    zero: int = 0


SETUPS = {s.name: s for s in (
    Setup("meshtron dp=2 zero=1", "meshtron", 2, 1),
    Setup("meshtron dp=2 zero=0", "meshtron", 2, 0),
    Setup("DCP dp=2 (DDP)", "dcp", 2),
    Setup("meshtron 1 proc", "meshtron", 1),
    Setup("DCP 1 proc", "dcp", 1),
)}
PAIRS = [("meshtron dp=2 zero=1", "DCP dp=2 (DDP)"), ("meshtron dp=2 zero=0", "DCP dp=2 (DDP)"),
         ("meshtron 1 proc", "DCP 1 proc")]


# ---------------------------------------------------------------------------------- helpers


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, value) of every leaf of nested dicts and lists, in a fixed order."""
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from leaves(obj[key], f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from leaves(value, f"{prefix}/{i}")
    else:
        yield prefix, obj


def same_state(a: list[tuple[str, Any]], b: list[tuple[str, Any]]) -> bool:
    """Equal names and exactly equal values (tensors bit for bit, by ``torch.equal``)."""
    import torch

    if [n for n, _ in a] != [n for n, _ in b]:
        return False
    for (_, x), (_, y) in zip(a, b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                    and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def snapshot(state: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    import torch

    return [(n, v.clone() if isinstance(v, torch.Tensor) else v) for n, v in state]


def evict(path: Path) -> int | None:
    """fsync every file under ``path`` and drop it from the page cache; the bytes of it still
    resident afterwards (``fincore``), or None when ``fincore`` is not installed."""
    files = [f for f in path.rglob("*") if f.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES",
                          *map(str, files)], capture_output=True, text=True, check=True)
    return sum(int(x) for x in out.stdout.split())


def file_sizes(path: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file()}


# ---------------------------------------------------------------------------------- sides


class MeshtronSide:
    """A trained model and optimizer, a fresh pair to load into, and meshtron's savers."""

    def __init__(self, cfg: Any, setup: Setup, rank: int, root: Path):
        import torch

        from meshtron.checkpoint.saver import CheckpointSaver
        from meshtron.parallel.layout import MeshLayout
        from meshtron.parallel.mesh import ParallelMesh
        from meshtron.precision.policy import Precision

        self.cfg, self.rank, self.world = cfg, rank, setup.world
        self.mesh = ParallelMesh(MeshLayout(setup.world), rank)
        self.model, self.optimizer = self._build(setup.zero, seed=0)
        self.fresh, self.fresh_optimizer = self._build(setup.zero, seed=1)
        self.fresh_optimizer.init_state()
        self.precision = Precision("fp32", torch.device("cpu"))
        self.savers = {mode: CheckpointSaver(root, rank, setup.world, mode, keep_last=0,
                                             asynchronous=mode == "async")
                       for mode in ("sync", "async")}
        self.opened: list[str] = []
        self.pieces: list[Any] = []
        self.finished: float | None = None

    def _build(self, zero: int, seed: int) -> tuple[Any, Any]:
        from meshtron.models.init import initialize
        from meshtron.models.transformer import Transformer
        from meshtron.optim.data_parallel import DataParallelOptimizer

        model = Transformer(self.cfg.model, self.mesh)
        initialize(model, seed=seed, std=self.cfg.model.init_std,
                   num_layers=self.cfg.model.num_layers)
        model.train()
        return model, DataParallelOptimizer(model, self.mesh, self.cfg.train, zero=zero,
                                            bucket_mb=25.0)

    def train(self, batch: Any) -> None:
        from meshtron.training.step import train_step

        mine = batch[self.rank : self.rank + 1]
        train_step(self.model, self.optimizer, mine, self.mesh, global_tokens=self.world * SEQ,
                   micro_batch=1, lr=LR, grad_clip=self.cfg.train.grad_clip,
                   precision=self.precision)

    def save(self, step: int, mode: str) -> tuple[Path, dict[str, float]]:
        """Capture and save (sync: until written and past the barrier; async: until the call
        returns)."""
        import torch.distributed as dist

        from meshtron.checkpoint import train_state

        start = time.perf_counter()
        pieces = train_state.capture(self.model, self.optimizer, self.mesh)
        captured = time.perf_counter()
        path = self.savers[mode].save(step, pieces, train_state.optimizer_meta(self.optimizer),
                                      {})
        if mode == "sync":
            dist.barrier()
        else:
            self.pieces, self.finished = pieces, None
            self.savers[mode].pending[1].add_done_callback(self._finish)
        return path, {"prepare_s": captured - start, "call_s": time.perf_counter() - captured}

    def _finish(self, _: Any) -> None:
        self.finished = time.perf_counter()

    def done(self) -> bool:
        pending = self.savers["async"].pending
        return pending is None or pending[1].done()

    def wait(self) -> None:
        self.savers["async"].wait()

    def load(self, path: Path) -> None:
        from meshtron.checkpoint import train_state
        from meshtron.checkpoint.store import open_checkpoint

        manifest, reader = open_checkpoint(path)
        train_state.restore(path, manifest, reader, self.fresh, self.fresh_optimizer, self.mesh)
        self.opened = sorted(reader._open)

    def state(self, fresh: bool = False) -> list[tuple[str, Any]]:
        """Everything this rank's checkpoint holds of the model and optimizer."""
        import torch

        from meshtron.checkpoint.held import held_tensors

        model, optimizer = (self.fresh, self.fresh_optimizer) if fresh else (self.model,
                                                                             self.optimizer)
        out: list[tuple[str, Any]] = [(h.name, h.flat)
                                      for h in held_tensors(model, optimizer, self.mesh)]
        return out + [("steps", torch.tensor(optimizer.steps_taken))]

    def describe(self, path: Path) -> dict[str, Any]:
        """Tensor bytes in the checkpoint (manifest) and the bytes of this rank's files."""
        from meshtron.checkpoint.shards import DTYPES, shard_name
        from meshtron.checkpoint.store import read_manifest

        manifest = read_manifest(path)
        total = sum(math.prod(piece["size"]) * DTYPES[entry["dtype"]].itemsize
                    for entry in manifest["tensors"].values() for piece in entry["pieces"])
        sizes = file_sizes(path)
        mine = [f"{shard_name(self.rank)}.safetensors", f"{shard_name(self.rank)}.json"]
        if self.rank == 0:
            mine += ["meta.json"]
        return {"tensor_bytes": total, "files": sizes,
                "written_bytes": sum(sizes.get(f, 0) for f in mine)}

    def recapture_seconds(self) -> float:
        """Time of copying this rank's pieces once more into the buffers of the last capture,
        now in memory: what a capture that reused its buffers would cost."""
        import torch

        from meshtron.checkpoint.held import held_tensors

        start = time.perf_counter()
        buffers = iter(self.pieces)
        with torch.no_grad():
            for held in held_tensors(self.model, self.optimizer, self.mesh):
                if held.writes:
                    for local_box, _ in held.boxes():
                        next(buffers).data.copy_(held.view(local_box))
        return time.perf_counter() - start

    def checksum_seconds(self, path: Path) -> float:
        """Time of ``sha256`` over the files this rank's last load opened."""
        from meshtron.checkpoint.shards import sha256

        start = time.perf_counter()
        for name in self.opened:
            sha256(path / name)
        return time.perf_counter() - start

    def close(self) -> None:
        for saver in self.savers.values():
            saver.close()


class DcpSide:
    """The same model under plain torch (DDP when dp=2), saved and loaded with DCP."""

    def __init__(self, cfg: Any, setup: Setup, rank: int, root: Path):
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.cfg, self.rank, self.world, self.root = cfg, rank, setup.world, root
        self.pg = dist.new_group(backend="gloo")
        self.model, self.net, self.optimizer = self._build(seed=0)
        self.fresh, self.fresh_net, self.fresh_optimizer = self._build(seed=1)
        get_state_dict(self.fresh_net, self.fresh_optimizer)  # allocates the AdamW state
        self.future: Any = None
        self.finished: float | None = None

    def _build(self, seed: int) -> tuple[Any, Any, Any]:
        import torch

        from meshtron.models.init import initialize
        from meshtron.models.transformer import Transformer
        from meshtron.optim.adamw import build_adamw, set_learning_rate

        model = Transformer(self.cfg.model)
        initialize(model, seed=seed, std=self.cfg.model.init_std,
                   num_layers=self.cfg.model.num_layers)
        model.train()
        net = torch.nn.parallel.DistributedDataParallel(model) if self.world > 1 else model
        optimizer = build_adamw(model, self.cfg.train)
        set_learning_rate(optimizer, LR)
        return model, net, optimizer

    def train(self, batch: Any) -> None:
        import torch

        mine = batch[self.rank : self.rank + 1]
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model.loss_sum(self.net(mine[:, :-1]), mine[:, 1:])
        (loss / SEQ).backward()  # DDP averages over ranks: the global mean, as meshtron's
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip,
                                       foreach=True)
        self.optimizer.step()

    def save(self, step: int, mode: str) -> tuple[Path, dict[str, float]]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = self.root / f"{mode}_{step:08d}"
        start = time.perf_counter()
        model_sd, optim_sd = get_state_dict(self.net, self.optimizer)
        prepared = time.perf_counter()
        state = {"model": model_sd, "optim": optim_sd}
        if mode == "sync":
            dcp.save(state, checkpoint_id=path, process_group=self.pg)
        else:
            self.future, self.finished = dcp.async_save(state, checkpoint_id=path,
                                                        process_group=self.pg), None
            self.future.add_done_callback(self._finish)
        return path, {"prepare_s": prepared - start, "call_s": time.perf_counter() - prepared}

    def _finish(self, _: Any) -> None:
        self.finished = time.perf_counter()

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def load(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.fresh_net, self.fresh_optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path, process_group=self.pg)
        set_state_dict(self.fresh_net, self.fresh_optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def state(self, fresh: bool = False) -> list[tuple[str, Any]]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        net, optimizer = (self.fresh_net, self.fresh_optimizer) if fresh else (self.net,
                                                                               self.optimizer)
        model_sd, optim_sd = get_state_dict(net, optimizer)
        return list(leaves({"model": model_sd, "optim": optim_sd}))

    def describe(self, path: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        total = sum(math.prod(m.size) * m.properties.dtype.itemsize
                    for m in metadata.state_dict_metadata.values()
                    if isinstance(m, TensorStorageMetadata))
        sizes = file_sizes(path)
        written = sum(size for name, size in sizes.items()
                      if name.startswith(f"__{self.rank}_")
                      or (self.rank == 0 and name == ".metadata"))
        return {"tensor_bytes": total, "files": sizes, "written_bytes": written}

    def checksum_seconds(self, path: Path) -> float | None:
        return None

    def recapture_seconds(self) -> float | None:
        return None

    def close(self) -> None:
        self.wait()


# ---------------------------------------------------------------------------------- workers


def batch_for(i: int) -> Any:
    import torch

    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(100 + i))


def run_setup(rank: int, setup: Setup, args: dict[str, Any], verify_async: bool
              ) -> dict[str, Any]:
    """One configuration in this process group; this rank's figures."""
    import torch
    import torch.distributed as dist

    from meshtron.config import load_config

    cfg = load_config(overrides=[
        "--model.preset=small", f"--model.num_layers={args['layers']}",
        f"--model.vocab_size={VOCAB}", f"--train.seq_len={SEQ}",
        f"--train.global_batch={setup.world}", "--train.micro_batch=1"])
    root = Path(args["dir"]) / setup.name.replace(" ", "_").replace("(", "").replace(")", "")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    begun_setup = time.perf_counter()
    side: MeshtronSide | DcpSide = (MeshtronSide if setup.family == "meshtron" else DcpSide)(
        cfg, setup, rank, root)
    out: dict[str, Any] = {"params": sum(p.numel() for p in side.model.parameters())}
    set_up = []
    for i in range(2):  # the first creates the AdamW state; the second is the baseline step
        dist.barrier()
        start = time.perf_counter()
        side.train(batch_for(i))
        set_up.append(time.perf_counter() - start)
    out["baseline_step_s"] = set_up[1]
    state_bytes = sum(v.numel() * v.element_size() for _, v in side.state()
                      if isinstance(v, torch.Tensor))
    out["state_bytes"] = state_bytes

    def timed(action: Callable[[], Any]) -> tuple[float, Any]:
        dist.barrier()
        start = time.perf_counter()
        value = action()
        dist.barrier()
        return time.perf_counter() - start, value

    out["save_s"], (path, phases) = timed(lambda: side.save(2, "sync"))
    out["save_prepare_s"] = phases["prepare_s"]
    out.update(side.describe(path))
    out["resident_after_evict"] = evict(path) if rank == 0 else None
    out["load_cold_s"], _ = timed(lambda: side.load(path))
    out["verified"] = same_state(side.state(), side.state(fresh=True))
    out["load_warm_s"], _ = timed(lambda: side.load(path))
    out["checksum_s"] = side.checksum_seconds(path)

    reference = snapshot(side.state()) if verify_async else None
    dist.barrier()
    start = time.perf_counter()
    async_path, phases = side.save(3, "async")
    out["stall_s"] = time.perf_counter() - start
    out["stall_prepare_s"] = phases["prepare_s"]
    overlap = []
    while len(overlap) < args["overlap_steps"]:
        begun = time.perf_counter()
        side.train(batch_for(2 + len(overlap)))
        overlap.append(time.perf_counter() - begun)
        pending = torch.tensor([0.0 if side.done() else 1.0])
        dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        if pending.item() == 0.0:
            break
    side.wait()
    dist.barrier()
    out["async_total_s"] = time.perf_counter() - start
    assert side.finished is not None
    out["async_write_s"] = side.finished - start
    out["overlap_steps_s"] = overlap
    out["recapture_s"] = side.recapture_seconds()
    if reference is not None:
        side.load(async_path)
        out["verified_async"] = same_state(reference, side.state(fresh=True))
        out["async_tensor_bytes"] = side.describe(async_path)["tensor_bytes"]
    side.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)
    out["wall_s"] = time.perf_counter() - begun_setup
    return out


def group_task(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Every configuration of ``args['order']`` in turn, in this process group."""
    out = {}
    for name in args["order"]:
        out[name] = run_setup(rank, SETUPS[name], args, args["verify_async"])
        gc.collect()  # the configuration's models and checkpoint copies are gone before the next
    return out


# ---------------------------------------------------------------------------------- report


def machine(directory: Path) -> dict[str, Any]:
    from harness import host_info

    df = subprocess.run(["df", "-PT", str(directory)], capture_output=True, text=True)
    fields = df.stdout.splitlines()[-1].split() if df.returncode == 0 else []
    return host_info(
        loadavg_start=Path("/proc/loadavg").read_text().strip(),
        filesystem={"device": fields[0], "type": fields[1], "mount": fields[6],
                    "available_kb": int(fields[4])} if len(fields) >= 7 else None,
        memory_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
    )


def combine(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration of one round: times of the slowest rank, bytes per rank."""
    first = ranks[0]
    slowest = {key: max(r[key] for r in ranks)
               for key in ("save_s", "save_prepare_s", "load_cold_s", "load_warm_s", "stall_s",
                           "stall_prepare_s", "async_total_s", "async_write_s",
                           "baseline_step_s", "wall_s")}
    overlap = [max(ts) for ts in zip(*(r["overlap_steps_s"] for r in ranks))]
    checksums = [r["checksum_s"] for r in ranks]
    recaptures = [r["recapture_s"] for r in ranks]
    return {
        **slowest, "overlap_steps_s": overlap,
        "checksum_s": max(checksums) if checksums[0] is not None else None,
        "recapture_s": max(recaptures) if recaptures[0] is not None else None,
        "tensor_bytes": first["tensor_bytes"], "files": first["files"],
        "written_bytes": [r["written_bytes"] for r in ranks],
        "state_bytes": [r["state_bytes"] for r in ranks],
        "resident_after_evict": first["resident_after_evict"],
        "verified": all(r["verified"] for r in ranks),
        "verified_async": (all(r["verified_async"] for r in ranks)
                           if "verified_async" in first else None),
        "params": first["params"],
    }


def summarize(name: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    mb = rounds[0]["tensor_bytes"] / MB
    overlap = [t for r in rounds for t in r["overlap_steps_s"]]
    row = {
        "name": name, "tensor_mb": mb, "params": rounds[0]["params"],
        "files": rounds[0]["files"], "written_mb": [b / MB for b in rounds[0]["written_bytes"]],
        "state_mb": [b / MB for b in rounds[0]["state_bytes"]],
        "save_s": med("save_s"), "save_prepare_s": med("save_prepare_s"),
        "load_cold_s": med("load_cold_s"), "load_warm_s": med("load_warm_s"),
        "stall_s": med("stall_s"), "stall_prepare_s": med("stall_prepare_s"),
        "async_total_s": med("async_total_s"), "async_write_s": med("async_write_s"),
        "baseline_step_s": med("baseline_step_s"),
        "wall_s": med("wall_s"),
        "overlap_step_s": statistics.median(overlap) if overlap else None,
        "overlap_steps": [len(r["overlap_steps_s"]) for r in rounds],
        "checksum_s": (statistics.median(r["checksum_s"] for r in rounds)
                       if rounds[0]["checksum_s"] is not None else None),
        "recapture_s": (statistics.median(r["recapture_s"] for r in rounds)
                        if rounds[0]["recapture_s"] is not None else None),
        "resident_after_evict": [r["resident_after_evict"] for r in rounds],
        "verified": all(r["verified"] for r in rounds),
        "verified_async": [r["verified_async"] for r in rounds if r["verified_async"] is not None],
        "rounds": rounds,
    }
    row["save_mb_s"] = mb / row["save_s"]
    row["load_cold_mb_s"] = mb / row["load_cold_s"]
    row["load_warm_mb_s"] = mb / row["load_warm_s"]
    row["stall_fraction"] = row["stall_s"] / row["save_s"]
    row["stall_fraction_rounds"] = [r["stall_s"] / r["save_s"] for r in rounds]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of every configuration, in fresh processes, order rotating")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (small shape)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the checkpoints are written (a fresh subdirectory)")
    parser.add_argument("--overlap-steps", type=int, default=1,
                        help="most training steps run while an async save writes")
    parser.add_argument("--configs", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    parser.add_argument("--timeout", type=float, default=600, help="seconds per process group")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="meshtron-ckpt-bench-", dir=args.dir))
    info = machine(work)
    fs = info["filesystem"] or {}
    print(f"{info['date']}  {info['cpu']}, {info['cores']} cores, {info['memory_gib']:.0f} GiB, "
          f"torch {info['torch']}, Python {info['python']}; /proc/loadavg {info['loadavg_start']}",
          flush=True)
    print(f"checkpoints in {work}: {fs.get('type')} on {fs.get('device')} (mounted at "
          f"{fs.get('mount')}, {fs.get('available_kb', 0) / 2**20:.0f} GiB free)", flush=True)
    print(f"small llama shape with {args.layers} layers, vocab {VOCAB}, fp32 AdamW state after 2 "
          f"steps; {args.rounds} rounds; gloo, 1 thread per process", flush=True)
    started = time.monotonic()
    names = list(args.configs)
    by_world = {w: [n for n in names if SETUPS[n].world == w] for w in (2, 1)}
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        for r in range(args.rounds):
            worlds = [w for w in (2, 1) if by_world[w]]
            if r % 2:
                worlds.reverse()
            for world in worlds:
                group = by_world[world]
                order = group[r % len(group):] + group[: r % len(group)]
                task = {"order": order, "dir": str(work), "layers": args.layers,
                        "overlap_steps": args.overlap_steps, "verify_async": r == 0}
                ranks = spawn(group_task, world, task, timeout=args.timeout)
                for name in order:
                    row = combine([rank[name] for rank in ranks])
                    results[name].append(row)
                    print(f"  round {r + 1}: {name:<21} save {row['save_s']:6.2f} s, load cold "
                          f"{row['load_cold_s']:5.2f} / warm {row['load_warm_s']:5.2f} s, "
                          f"stall {row['stall_s']:5.2f} s, async write "
                          f"{row['async_write_s']:5.2f} s, total {row['async_total_s']:5.2f} s "
                          f"({len(row['overlap_steps_s'])} steps overlapped), verified "
                          f"{row['verified']}"
                          + (f", async verified {row['verified_async']}"
                             if row["verified_async"] is not None else ""), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    info["wall_s"] = time.monotonic() - started
    rows = {n: summarize(n, results[n]) for n in names}

    print(f"\n/proc/loadavg at the end {info['loadavg_end']}; {info['wall_s']:.0f} s in all")
    print("\nBytes: MB = 10^6 bytes of tensor data in the checkpoint (its own index); written = "
          "file bytes each rank wrote; state = tensor bytes each rank holds and loads")
    for row in rows.values():
        files = ", ".join(f"{k} {v / MB:.1f}" for k, v in row["files"].items())
        print(f"{row['name']:<21} {row['tensor_mb']:8.1f} MB ({row['params'] / 1e6:.1f}M "
              f"parameters); written per rank {' / '.join(f'{x:.1f}' for x in row['written_mb'])}"
              f" MB; state per rank {' / '.join(f'{x:.1f}' for x in row['state_mb'])} MB; files "
              f"(MB): {files}")
    nan = float("nan")

    def num(value: float | None) -> float:
        return nan if value is None else value

    print("\nmedians over rounds, slowest rank; MB/s = checkpoint MB / time; prep s: the part "
          "of the sync save before writing (meshtron's capture, a host copy; DCP's "
          "get_state_dict, no copy); sha256 s: meshtron's checksum of the files its load opens, "
          "timed separately on warm files")
    print(f"{'configuration':<21} {'save s':>6} {'MB/s':>5} {'prep s':>6} {'cold s':>6} "
          f"{'MB/s':>5} {'warm s':>6} {'MB/s':>5} {'sha256 s':>8}  verified")
    for row in rows.values():
        print(f"{row['name']:<21} {row['save_s']:>6.2f} {row['save_mb_s']:>5.0f} "
              f"{row['save_prepare_s']:>6.2f} {row['load_cold_s']:>6.2f} "
              f"{row['load_cold_mb_s']:>5.0f} {row['load_warm_s']:>6.2f} "
              f"{row['load_warm_mb_s']:>5.0f} {num(row['checksum_s']):>8.2f}  {row['verified']}")
    print("\nasync: stall = until the save call returns (prep s: before the call: meshtron's "
          "capture, DCP's get_state_dict; DCP copies inside async_save); reuse s: copying the "
          "same pieces into the already allocated capture buffers (meshtron); write s: until "
          "the background save finished; total s: until every rank's save is done, after the "
          "overlapping step; step s: a training step with no save in flight, overlap s: while "
          "an async save writes; wall s: the whole configuration, set-up included")
    print(f"{'configuration':<21} {'stall s':>7} {'prep s':>6} {'stall/save':>10} "
          f"{'reuse s':>7} {'write s':>7} {'total s':>7} {'step s':>6} {'overlap s':>9} "
          f"{'wall s':>6}  verified")
    for row in rows.values():
        print(f"{row['name']:<21} {row['stall_s']:>7.2f} {row['stall_prepare_s']:>6.2f} "
              f"{row['stall_fraction']:>10.2f} {num(row['recapture_s']):>7.2f} "
              f"{row['async_write_s']:>7.2f} {row['async_total_s']:>7.2f} "
              f"{row['baseline_step_s']:>6.2f} {num(row['overlap_step_s']):>9.2f} "
              f"{row['wall_s']:>6.0f}  {row['verified_async']}")
    resident = {n: r["resident_after_evict"] for n, r in rows.items()}
    print(f"bytes of the checkpoint still in the page cache after eviction, per round: {resident}")

    pairs = []
    print("\nratio = meshtron throughput / DCP throughput (above 1: meshtron faster); round = "
          "median over rounds of the per-round ratio")
    print(f"{'meshtron':<21} {'DCP':<15} {'save':>5} {'round':>5} {'cold':>5} {'round':>5} "
          f"{'warm':>5} {'round':>5}")
    for ours, theirs in PAIRS:
        if ours not in rows or theirs not in rows:
            continue
        a, b = rows[ours], rows[theirs]
        pair: dict[str, Any] = {"meshtron": ours, "dcp": theirs}
        for key in ("save", "load_cold", "load_warm"):
            pair[key] = a[f"{key}_mb_s"] / b[f"{key}_mb_s"]
            pair[f"{key}_round"] = statistics.median(
                (x["tensor_bytes"] / x[f"{key}_s"]) / (y["tensor_bytes"] / y[f"{key}_s"])
                for x, y in zip(a["rounds"], b["rounds"]))
        pairs.append(pair)
        print(f"{ours:<21} {theirs:<15} {pair['save']:>5.2f} {pair['save_round']:>5.2f} "
              f"{pair['load_cold']:>5.2f} {pair['load_cold_round']:>5.2f} "
              f"{pair['load_warm']:>5.2f} {pair['load_warm_round']:>5.2f}")

    print("\ngoals: throughput >= 1.0x DCP (save, cold load, warm load); async stall <= 10% of a "
          "sync save")
    for pair in pairs:
        for key in ("save", "load_cold", "load_warm"):
            print(f"  {pair['meshtron']} vs {pair['dcp']}, {key}: {pair[key]:.2f}x -> "
                  f"{'met' if pair[key] >= 1.0 else 'NOT met'}")
    for row in rows.values():
        if SETUPS[row["name"]].family == "meshtron":
            print(f"  {row['name']}: stall {row['stall_s']:.2f} s = "
                  f"{100 * row['stall_fraction']:.0f}% of a sync save ({row['save_s']:.2f} s) -> "
                  f"{'met' if row['stall_fraction'] <= 0.10 else 'NOT met'}")
    if args.json:
        out = {"machine": info, "command": " ".join(sys.argv),
               "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "configurations": rows, "pairs": pairs}
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
