"""A checkpoint saved under one layout resumes under another and continues the same run.

Layout A trains 20 steps and saves at step 10; layout B resumes from that step-10 checkpoint.
B's steps 11-20 must match the uninterrupted one-process run (1e-4 relative, as the parity
contract) and, when B is A itself, A's own steps bit for bit.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
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


@pytest.mark.slow
def test_resume_under_another_layout_continues_the_run(data_cache, tmp_path):
    root = str(tmp_path)
    saved: dict[str, dict] = {}
    resumed: dict[int, list] = {}
    save_worlds, resume_worlds = {w for w, _ in SAVE.values()}, {w for _, w, _ in RESUME}

    def resume_jobs(world: int) -> list[tuple]:
        return [(s, layout) for s, w, layout in RESUME if w == world]

    for world in sorted(save_worlds):
        names = [n for n, (w, _) in SAVE.items() if w == world]
        if world == 1:
            saved.update(save_runs(0, 1, data_cache, root, names))
        elif world in resume_worlds and {s for s, _ in resume_jobs(world)} <= {
                n for n, (w, _) in SAVE.items() if w <= world}:  # one spawn instead of two
            group_saved, resumed[world] = run_distributed(
                save_and_resume_runs, world, data_cache, root, names, resume_jobs(world),
                timeout=900)[0]
            saved.update(group_saved)
        else:
            saved.update(run_distributed(save_runs, world, data_cache, root, names,
                                         timeout=900)[0])
    reference = run_training(test_overrides(data_cache, f"{root}/reference") + MODEL)
    for world in sorted(resume_worlds):
        jobs = resume_jobs(world)
        if world in resumed:
            results = resumed[world]
        elif world == 1:
            results = resume_runs(0, 1, data_cache, root, jobs)
        else:
            results = run_distributed(resume_runs, world, data_cache, root, jobs,
                                      timeout=900)[0]
        assert len(results) == len(jobs)
        for (source, layout), result in zip(jobs, results):
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
