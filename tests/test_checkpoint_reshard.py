"""A checkpoint saved under one layout resumes under another and continues the same run.

Layout A trains 20 steps and saves at step 10; layout B resumes from that step-10 checkpoint.
B's steps 11-20 must match the uninterrupted one-process run (1e-4 relative, as the parity
contract) and, when B is A itself, A's own steps bit for bit.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed, start_distributed
from tests.parity import PARITY_RTOL, run_training, test_overrides

MODEL = ["--model.num_layers=4", "--train.micro_batch=2", "--parallel.bucket_mb=0.02"]
SAVE = {  # name -> (world size, layout)
    "one": (1, []),
    "tp2": (2, ["--parallel.tp=2"]),
    "pp2": (2, ["--parallel.pp=2", "--model.tie_embeddings=false",
                "--parallel.pp_layers=2.5,1.5"]),  # layer 2 cut between the stages
    "vpp2": (2, ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.schedule=interleaved"]),
    "dp2z1": (2, ["--parallel.zero=1", "--checkpoint.async=true"]),
    "3d": (8, ["--parallel.tp=2", "--parallel.pp=2", "--parallel.zero=1",
               "--train.micro_batch=1"]),
}
RESUME = [  # (saved as, world size, resumed layout)
    ("tp2", 1, []),
    ("one", 4, ["--parallel.tp=4"]),
    ("pp2", 1, []),
    ("one", 2, ["--parallel.pp=2", "--parallel.schedule=zb-h1", "--parallel.pp_layers=1.5,2.5"]),
    ("vpp2", 1, []),
    ("vpp2", 2, ["--parallel.pp=2", "--parallel.vpp=2", "--parallel.schedule=zb-v"]),  # V
    ("dp2z1", 4, ["--parallel.zero=3", "--train.micro_batch=1"]),
    ("3d", 1, []),
    ("tp2", 2, ["--parallel.tp=2"]),  # the same layout: bit-identical
]


def _overrides(cache: str, root: str, name: str, layout: list[str], extra: list[str]) -> list[str]:
    return test_overrides(cache, f"{root}/{name}") + MODEL + layout + extra


def save_runs(rank: int, world_size: int, cache: str, root: str, names: list[str]) -> dict:
    return {name: run_training(_overrides(cache, root, name, SAVE[name][1],
                                          ["--checkpoint.every=10"]), rank, world_size)
            for name in names}


def resume_runs(rank: int, world_size: int, cache: str, root: str, jobs: list[tuple]) -> list:
    out = []
    for i, (saved, layout) in enumerate(jobs):
        step10 = f"{root}/{saved}/checkpoints/step_00000010"
        out.append(run_training(
            _overrides(cache, root, f"resume{world_size}_{i}", layout,
                       ["--checkpoint.resume=true", f"--checkpoint.dir={step10}"]),
            rank, world_size))
    return out


def save_and_resume_runs(rank: int, world_size: int, cache: str, root: str, names: list[str],
                         jobs: list[tuple]) -> tuple[dict, list]:
    """One group of processes for both: its saves, then its resumes (which need only the
    checkpoints saved before them: by one process, or by this group itself)."""
    return (save_runs(rank, world_size, cache, root, names),
            resume_runs(rank, world_size, cache, root, jobs))


def resume_jobs(world: int) -> list[tuple]:
    return [(saved, layout) for saved, w, layout in RESUME if w == world]


def saved_on(world: int) -> list[str]:
    return [name for name, (w, _) in SAVE.items() if w == world]


def run_groups(cache: str, root: str) -> tuple[dict, dict, dict]:
    """Every save, every resume and the one-process reference: (saved runs by name, resumed
    runs by world size, the reference). The one-process runs train in this process while 8
    or 4 ranks run, whose collectives leave the 2 cores idle much of the time (2 ranks fill
    them: a third process beside them only slows them down): while 8 ranks save, the one
    process saves and trains the reference; then 2 ranks save and resume; while 4 ranks
    resume, the one process resumes from every layout's checkpoint."""
    saved: dict[str, dict] = {}

    def while_ranks(world: int, fn, args: tuple, here) -> object:
        ranks = start_distributed(fn, world, cache, root, *args, timeout=900)
        try:
            here()
        except BaseException:
            ranks.stop()
            raise
        return ranks.results()[0]

    def first() -> None:
        saved.update(save_runs(0, 1, cache, root, saved_on(1)))
        saved["reference"] = run_training(test_overrides(cache, f"{root}/reference") + MODEL)

    saved.update(while_ranks(8, save_runs, (saved_on(8),), first))
    group_saved, resumed_2 = run_distributed(save_and_resume_runs, 2, cache, root, saved_on(2),
                                             resume_jobs(2), timeout=900)[0]
    saved.update(group_saved)
    resumed = {2: resumed_2}
    resumed[4] = while_ranks(4, resume_runs, (resume_jobs(4),), lambda: resumed.update(
        {1: resume_runs(0, 1, cache, root, resume_jobs(1))}))
    reference = saved.pop("reference")
    return saved, {w: list(zip(resume_jobs(w), runs, strict=True))
                   for w, runs in resumed.items()}, reference


@pytest.mark.slow
def test_resume_under_another_layout_continues_the_run(data_cache, tmp_path):
    assert {w for w, _ in SAVE.values()} == {1, 2, 8}  # the groups run_groups runs
    assert {w for _, w, _ in RESUME} == {1, 2, 4}
    saved, resumed, reference = run_groups(data_cache, str(tmp_path))
    assert sum(len(jobs) for jobs in resumed.values()) == len(RESUME)
    for world, jobs in sorted(resumed.items()):
        for (source, layout), result in jobs:
            what = f"saved as {source}, resumed on {world} ranks with {' '.join(layout) or '-'}"
            assert len(result["loss"]) == 10, what
            same_layout = SAVE[source] == (world, layout)
            for key in ("loss", "grad_norm"):
                for step, (ref, own, got) in enumerate(
                        zip(reference[key][10:], saved[source][key][10:], result[key]), 11):
                    if same_layout:
                        assert got == own, f"{what}: {key} at step {step} {got!r} != {own!r}"
                    assert abs(got - ref) <= PARITY_RTOL * abs(ref), (
                        f"{what}: {key} at step {step} is {got!r}, one process gives {ref!r}")
