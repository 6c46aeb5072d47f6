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
seed 1, so a load visibly changes them. Processes are spawned by ``benchmarks/harness``
(gloo, one torch thread each); dp=2 configurations run in two processes, the others in one
(``checkpoint_sides.py`` holds both implementations):

- ``meshtron dp=2 zero=1``: ``build_optimizer(zero=1)`` (ZeRO-1: each rank holds half of
  the AdamW moments) and ``train_step``. Saving: ``train_state.capture(copy=False)`` (this
  rank's pieces, as views of the host tensors: the trainer's synchronous save),
  ``CheckpointSaver.save`` (a safetensors shard hashed as it is written, fsync, shard index;
  rank 0 then waits for every index and writes the manifest, renames the directory and points
  ``latest`` at it), then a barrier (as the trainer does). The two ranks take turns over the
  replicated parameters (round-robin, so each writes about half of them), and each writes its
  own half of the moments. Loading: ``open_checkpoint`` + ``train_state.restore``
  into a freshly built model and optimizer: every rank reads only the slices it holds (all
  parameters, its half of the moments) straight into the live tensors from the mapped
  files, while a background thread computes the checksum of every file it opens; the restore
  checks them before it returns.
- ``meshtron dp=2 zero=0``: the same with replicated AdamW state (``torch.optim.AdamW``); the ranks
  take turns over every replicated tensor (round-robin), and each rank reads everything back.
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
- *checksum* (meshtron): afterwards, ``meshtron.checkpoint.digests.file_digest`` (XXH3-128)
  of the files this rank's load opened, timed separately (warm): what the check costs alone;
  in a load it runs in a background thread beside the copies.
- *async save*: ``capture`` + ``save`` on an asynchronous ``CheckpointSaver`` (meshtron), or
  ``get_state_dict`` + ``dcp.async_save`` (DCP; its default stager copies the state into newly
  allocated host memory, then a thread writes): the **stall** is the time until the call
  returns control to the training loop (per rank, no barrier), plus, for meshtron, the time
  the next step's update waited for the saver's thread to finish copying the state (as in the
  trainer, the copy runs beside that step's forward and backward, and the optimizer's update
  fence holds the update until it is done). Training steps then run while
  the write goes on (at most ``--overlap-steps``, default 1; after each step the ranks agree
  whether every rank's save is done); their time against the second set-up step (no save in
  flight) shows what the background write costs the steps on these shared cores. *write*: from
  the call until the save's future completes (a done-callback's ``perf_counter``; on meshtron's
  rank 0 that includes the manifest and rename). *total*: until every rank is past
  ``wait`` / ``future.result()`` and a barrier, so at least the overlapping step. As in the
  trainer, meshtron's async saver keeps its host buffers between saves, so the timed save
  copies into buffers that exist: *first capture* (meshtron) is the capture before it
  that allocated them, what the copy of a run's first background save costs (page faults on
  first touch). In the first round the async checkpoint is also
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

import functools
import gc
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from checkpoint_sides import SEQ, VOCAB, Setup, config, same_state, side, snapshot

MB = 1e6
SETUPS = {s.name: s for s in (
    Setup("meshtron dp=2 zero=1", "meshtron", 2, 1),
    Setup("meshtron dp=2 zero=0", "meshtron", 2, 0),
    Setup("DCP dp=2 (DDP)", "dcp", 2),
    Setup("meshtron 1 proc", "meshtron", 1),
    Setup("DCP 1 proc", "dcp", 1),
)}
PAIRS = [("meshtron dp=2 zero=1", "DCP dp=2 (DDP)"), ("meshtron dp=2 zero=0", "DCP dp=2 (DDP)"),
         ("meshtron 1 proc", "DCP 1 proc")]


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


# ---------------------------------------------------------------------------------- workers


def batch_for(i: int) -> Any:
    import torch

    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(100 + i))


def run_setup(rank: int, setup: Setup, args: dict[str, Any], verify_async: bool
              ) -> dict[str, Any]:
    """One configuration in this process group; this rank's figures."""
    import torch
    import torch.distributed as dist

    cfg = config(args["layers"], setup.world)
    root = Path(args["dir"]) / setup.name.replace(" ", "_").replace("(", "").replace(")", "")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    begun_setup = time.perf_counter()
    sd = side(cfg, setup, rank, root)
    out: dict[str, Any] = {"params": sum(p.numel() for p in sd.model.parameters())}

    def train(i: int) -> None:
        sd.train(batch_for(i))

    # the first step creates the AdamW state; the second is the baseline step
    set_up = [harness.timed(functools.partial(train, i), barrier=dist.barrier).wall
              for i in range(2)]
    out["baseline_step_s"] = set_up[1]
    out["state_bytes"] = sum(v.numel() * v.element_size() for _, v in sd.state()
                             if isinstance(v, torch.Tensor))

    def timed(action: Any) -> tuple[float, Any]:
        """Between two barriers: until every rank is done."""
        run = harness.timed(action, barrier=dist.barrier, settle=dist.barrier)
        return run.wall, run.value

    out["save_s"], (path, phases) = timed(lambda: sd.save(2, "sync"))
    out["save_prepare_s"] = phases["prepare_s"]
    out.update(sd.describe(path))
    out["resident_after_evict"] = evict(path) if rank == 0 else None
    out["load_cold_s"], _ = timed(lambda: sd.load(path))
    out["verified"] = same_state(sd.state(), sd.state(fresh=True))
    out["load_warm_s"], _ = timed(lambda: sd.load(path))
    out["checksum_s"] = sd.checksum_seconds(path)

    reference = snapshot(sd.state()) if verify_async else None
    out["first_capture_s"] = sd.first_capture_seconds()
    dist.barrier()
    start = time.perf_counter()
    async_path, phases = sd.save(3, "async")
    out["stall_s"] = time.perf_counter() - start
    out["stall_prepare_s"] = phases["prepare_s"]
    overlap: list[float] = []
    while len(overlap) < args["overlap_steps"]:
        overlap.append(harness.timed(functools.partial(train, 2 + len(overlap))).wall)
        pending = torch.tensor([0.0 if sd.done() else 1.0])
        dist.all_reduce(pending, op=dist.ReduceOp.MAX)
        if pending.item() == 0.0:
            break
    sd.wait()
    dist.barrier()
    out["async_total_s"] = time.perf_counter() - start
    out["stall_s"] += sd.update_wait_seconds()
    assert sd.finished is not None
    out["async_write_s"] = sd.finished - start
    out["overlap_steps_s"] = overlap
    if reference is not None:
        sd.load(async_path)
        out["verified_async"] = same_state(reference, sd.state(fresh=True))
        out["async_tensor_bytes"] = sd.describe(async_path)["tensor_bytes"]
    sd.close()
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
    df = subprocess.run(["df", "-PT", str(directory)], capture_output=True, text=True)
    fields = df.stdout.splitlines()[-1].split() if df.returncode == 0 else []
    return harness.host_info(
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
    first_captures = [r["first_capture_s"] for r in ranks]
    return {
        **slowest, "overlap_steps_s": overlap,
        "checksum_s": max(checksums) if checksums[0] is not None else None,
        "first_capture_s": max(first_captures) if first_captures[0] is not None else None,
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
        "first_capture_s": (statistics.median(r["first_capture_s"] for r in rounds)
                        if rounds[0]["first_capture_s"] is not None else None),
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


def run_rounds(args: Any, work: Path) -> dict[str, list[dict[str, Any]]]:
    """``--rounds`` rounds of every configuration in fresh process groups, the order rotating
    within a group and the two groups alternating; each configuration's per-round figures."""
    names = list(args.configs)
    by_world = {w: [n for n in names if SETUPS[n].world == w] for w in (2, 1)}
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.rounds):
        worlds = [w for w in (2, 1) if by_world[w]]
        if r % 2:
            worlds.reverse()
        for world in worlds:
            order = harness.rotated(by_world[world], r)
            task = {"order": order, "dir": str(work), "layers": args.layers,
                    "overlap_steps": args.overlap_steps, "verify_async": r == 0}
            ranks = harness.spawn(group_task, world, task, timeout=args.timeout)
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
    return results


def pair_figures(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """meshtron throughput / DCP throughput of every pair that ran: of the medians, and the
    median of the per-round ratios."""
    pairs = []
    for ours, theirs in PAIRS:
        if ours not in rows or theirs not in rows:
            continue
        a, b = rows[ours], rows[theirs]
        pair: dict[str, Any] = {"meshtron": ours, "dcp": theirs}
        for key in ("save", "load_cold", "load_warm"):
            pair[key] = a[f"{key}_mb_s"] / b[f"{key}_mb_s"]
            pair[f"{key}_round"] = harness.pair_ratio(
                [x["tensor_bytes"] / x[f"{key}_s"] for x in a["rounds"]],
                [y["tensor_bytes"] / y[f"{key}_s"] for y in b["rounds"]])
        pairs.append(pair)
    return pairs


def _num(value: float | None, spec: str) -> str:
    return format(float("nan") if value is None else value, spec)


def print_tables(rows: dict[str, dict[str, Any]], pairs: list[dict[str, Any]]) -> None:
    table = harness.markdown_table
    print("\nBytes: MB = 10^6 bytes of tensor data in the checkpoint (its own index); written = "
          "file bytes each rank wrote; state = tensor bytes each rank holds and loads\n")
    print(table(("configuration", "MB", "parameters", "written per rank MB",
                 "state per rank MB", "files (MB)"),
                ((r["name"], f"{r['tensor_mb']:.1f}", f"{r['params'] / 1e6:.1f}M",
                  " / ".join(f"{x:.1f}" for x in r["written_mb"]),
                  " / ".join(f"{x:.1f}" for x in r["state_mb"]),
                  ", ".join(f"{k} {v / MB:.1f}" for k, v in r["files"].items()))
                 for r in rows.values())))
    print("\nmedians over rounds, slowest rank; MB/s = checkpoint MB / time; prep s: the part "
          "of the sync save before writing (meshtron's capture: views on the host tensors; DCP's "
          "get_state_dict, no copy); check s: meshtron's checksum of the files its load opens, "
          "timed separately on warm files\n")
    print(table(("configuration", "save s", "MB/s", "prep s", "cold s", "MB/s", "warm s",
                 "MB/s", "check s", "verified"),
                ((r["name"], f"{r['save_s']:.2f}", f"{r['save_mb_s']:.0f}",
                  f"{r['save_prepare_s']:.2f}", f"{r['load_cold_s']:.2f}",
                  f"{r['load_cold_mb_s']:.0f}", f"{r['load_warm_s']:.2f}",
                  f"{r['load_warm_mb_s']:.0f}", _num(r["checksum_s"], ".2f"), r["verified"])
                 for r in rows.values())))
    print("\nasync: stall = until the save call returns, plus (meshtron) the next update's "
          "wait for the capture, which runs on the saver's thread; prep s: before the call "
          "(DCP's get_state_dict; DCP copies inside async_save); first s: meshtron's first "
          "capture, which allocates the kept buffers; write s: until "
          "the background save finished; total s: until every rank's save is done, after the "
          "overlapping step; step s: a training step with no save in flight, overlap s: while "
          "an async save writes; wall s: the whole configuration, set-up included\n")
    print(table(("configuration", "stall s", "prep s", "stall/save", "first s", "write s",
                 "total s", "step s", "overlap s", "wall s", "verified"),
                ((r["name"], f"{r['stall_s']:.2f}", f"{r['stall_prepare_s']:.2f}",
                  f"{r['stall_fraction']:.2f}", _num(r["first_capture_s"], ".2f"),
                  f"{r['async_write_s']:.2f}", f"{r['async_total_s']:.2f}",
                  f"{r['baseline_step_s']:.2f}", _num(r["overlap_step_s"], ".2f"),
                  f"{r['wall_s']:.0f}", r["verified_async"]) for r in rows.values())))
    resident = {n: r["resident_after_evict"] for n, r in rows.items()}
    print(f"\nbytes of the checkpoint still in the page cache after eviction, per round: "
          f"{resident}")
    print("\nratio = meshtron throughput / DCP throughput (above 1: meshtron faster); round = "
          "median over rounds of the per-round ratio\n")
    print(table(("meshtron", "DCP", "save", "round", "cold", "round", "warm", "round"),
                ((p["meshtron"], p["dcp"], *(f"{p[k]:.2f}" for k in (
                    "save", "save_round", "load_cold", "load_cold_round", "load_warm",
                    "load_warm_round"))) for p in pairs)))
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


def main() -> None:
    cli = harness.cli
    parser = cli.parser(
        __doc__, cli.rounds(3, "runs of every configuration, in fresh processes, order rotating"),
        cli.configs(list(SETUPS)), cli.timeout(600, "seconds per process group"))
    parser.add_argument("--layers", type=int, default=2, help="transformer layers (small shape)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the checkpoints are written (a fresh subdirectory)")
    parser.add_argument("--overlap-steps", type=int, default=1,
                        help="most training steps run while an async save writes")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="meshtron-ckpt-bench-", dir=args.dir))
    info = machine(work)
    fs = info["filesystem"] or {}
    print(harness.host_line(info, f"{info['memory_gib']:.0f} GiB memory"), flush=True)
    print(f"checkpoints in {work}: {fs.get('type')} on {fs.get('device')} (mounted at "
          f"{fs.get('mount')}, {fs.get('available_kb', 0) / 2**20:.0f} GiB free)", flush=True)
    print(f"small llama shape with {args.layers} layers, vocab {VOCAB}, fp32 AdamW state after 2 "
          f"steps; {args.rounds} rounds; gloo, 1 thread per process", flush=True)
    started = time.monotonic()
    try:
        results = run_rounds(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    info["wall_s"] = time.monotonic() - started
    rows = {n: summarize(n, results[n]) for n in args.configs}
    print(f"\n/proc/loadavg at the end {info['loadavg_end']}; {info['wall_s']:.0f} s in all")
    pairs = pair_figures(rows)
    print_tables(rows, pairs)
    harness.write_json(args.json, harness.record(info, args=harness.plain_args(args),
                                                 configurations=rows, pairs=pairs))


if __name__ == "__main__":
    main()
