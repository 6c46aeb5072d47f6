"""The two checkpoint implementations that ``benchmarks/checkpoint.py`` times, behind one
interface (its docstring says what each does): meshtron's sharded saver and loader, and
``torch.distributed.checkpoint`` (DCP) on the same model.

A side holds a trained model and optimizer and a fresh pair to load into: ``train(batch)``;
``save(step, mode)`` ("sync": until written and past the barrier; "async": until the call
returns, then ``done()``, ``wait()`` and ``finished``, the ``perf_counter`` when the write
ended); ``load(path)`` into the fresh pair; ``state(fresh)``, everything the checkpoint holds,
for an exact comparison; ``describe(path)``, the checkpoint's tensor bytes and this rank's
files; ``checksum_seconds`` and ``first_capture_seconds`` (meshtron; None for DCP);
``close()``.

Every call into meshtron the checkpoint benchmark makes is in this module. Imports are inside
the functions, as in the benchmark: its parent process only launches and prints.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEQ = 64
VOCAB = 32000
LR = 1e-4


@dataclass(frozen=True)
class Setup:
    name: str
    family: str
    """meshtron or dcp."""
    world: int
    zero: int = 0


def config(layers: int, world: int) -> Any:
    """The ``small`` preset with ``layers`` layers, one row of ``SEQ`` tokens per rank."""
    from meshtron.config import load_config

    return load_config(overrides=[
        "--model.preset=small", f"--model.num_layers={layers}", f"--model.vocab_size={VOCAB}",
        f"--train.seq_len={SEQ}", f"--train.global_batch={world}", "--train.micro_batch=1"])


def side(cfg: Any, setup: Setup, rank: int, root: Path) -> MeshtronSide | DcpSide:
    """The side of ``setup`` on this rank, saving under ``root``."""
    return (MeshtronSide if setup.family == "meshtron" else DcpSide)(cfg, setup, rank, root)


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


def file_sizes(path: Path) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file()}


class MeshtronSide:
    """A trained model and optimizer, a fresh pair to load into, and meshtron's savers."""

    def __init__(self, cfg: Any, setup: Setup, rank: int, root: Path):

        from meshtron.checkpoint.saver import CheckpointSaver
        from meshtron.parallel.mesh import MeshLayout, ParallelMesh

        self.cfg, self.rank, self.world = cfg, rank, setup.world
        self.mesh = ParallelMesh(MeshLayout(setup.world), rank)
        self.parts = self._build(setup.zero, seed=0)
        self.model, self.optimizer = self.parts.model, self.parts.optimizer
        fresh = self._build(setup.zero, seed=1)  # its optimizer state made, as a load needs
        self.fresh, self.fresh_optimizer = fresh.model, fresh.optimizer
        self.savers = {mode: CheckpointSaver(root, rank, setup.world, mode, keep_last=0,
                                             asynchronous=mode == "async")
                       for mode in ("sync", "async")}
        self.opened: list[str] = []
        self.finished: float | None = None
        self.update_wait = 0.0

    def _build(self, zero: int, seed: int) -> Any:
        from dataclasses import replace

        from meshtron.plan import plan_run
        from meshtron.rank import build_rank

        cfg = replace(self.cfg, train=replace(self.cfg.train, seed=seed),
                      parallel=replace(self.cfg.parallel, zero=zero, bucket_mb=25.0))
        return build_rank(plan_run(cfg, self.world), self.mesh)

    def train(self, batch: Any) -> None:
        from meshtron.training.step import train_step

        train_step(self.parts, batch[self.rank : self.rank + 1], LR)

    def save(self, step: int, mode: str) -> tuple[Path, dict[str, float]]:
        """Save as the trainer does. sync: the host tensors themselves, until written and past
        the barrier. async: until the call returns; the saver's thread copies the state into
        its kept buffers while the next step runs, and that step's update waits for the copy
        (the time it waited is :meth:`update_wait_seconds`)."""
        import torch.distributed as dist

        from meshtron.checkpoint import train_state

        start = time.perf_counter()
        saver = self.savers[mode]
        if mode == "sync":
            pieces: Any = train_state.capture(self.model, self.optimizer, self.mesh, copy=False)
        else:
            pieces = functools.partial(train_state.capture, self.model, self.optimizer,
                                       self.mesh, saver.buffers)
            self.update_wait = 0.0
            self.optimizer.fence_next_update(functools.partial(self._fence, saver))
        captured = time.perf_counter()
        path = saver.save(step, pieces, train_state.state_meta(self.optimizer, None), {})
        if mode == "sync":
            dist.barrier()
        else:
            self.finished = None
            self.savers[mode].pending[1].add_done_callback(self._finish)
        return path, {"prepare_s": captured - start, "call_s": time.perf_counter() - captured}

    def _fence(self, saver: Any) -> None:
        start = time.perf_counter()
        saver.wait_captured()
        self.update_wait += time.perf_counter() - start

    def update_wait_seconds(self) -> float:
        """How long the updates since the async save waited for its capture."""
        return self.update_wait

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

    def first_capture_seconds(self) -> float:
        """Time of the async saver's first capture, into newly allocated buffers (the stall
        of a run's first background save); later saves reuse them."""
        from meshtron.checkpoint import train_state

        start = time.perf_counter()
        train_state.capture(self.model, self.optimizer, self.mesh, self.savers["async"].buffers)
        return time.perf_counter() - start

    def checksum_seconds(self, path: Path) -> float:
        """Time of the checksum (``file_digest``) over the files this rank's last load opened."""
        from meshtron.checkpoint.digests import file_digest

        start = time.perf_counter()
        for name in self.opened:
            file_digest(path / name)
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

        model = Transformer(self.cfg.model)  # the peer's own: torch's DDP and AdamW
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

    def first_capture_seconds(self) -> float | None:
        return None

    def update_wait_seconds(self) -> float:
        return 0.0

    def close(self) -> None:
        self.wait()
