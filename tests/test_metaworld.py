"""Meta-World behind the environment seam (issue 49): seeds, rendering, instructions, the
experts' demonstrations in parallel processes, success counting on hand-made episodes, and a
policy trained and evaluated on two tasks. Small: 32x32 frames, two tasks, one episode each."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshtron.cli import main
from meshtron.data.demonstrations import generate_demonstrations
from meshtron.data.episodes import EpisodeDataset
from meshtron.envs import env_spec, make_env
from meshtron.envs.metaworld import MetaWorldEnv, import_metaworld
from meshtron.envs.metaworld_tasks import MT10_TASKS, PHRASINGS, phrasings, vocabulary
from meshtron.errors import MeshtronError
from meshtron.inference.evaluate_command import rollout_plan
from meshtron.inference.policy_eval import EVAL_SEED_BASE, Evaluation, RolloutPlan, rollouts
from tests.parity import run_layout
from tests.test_vla import _vla_layouts, vla_overrides

TWO = "metaworld:reach-v3+push-v3"


@pytest.fixture(scope="module")
def mw_demos(tmp_path_factory) -> str:
    """One expert episode of reach and one of push at 32x32, on two processes."""
    path = tmp_path_factory.mktemp("metaworld") / "demos"
    generate_demonstrations(2, 5, 32, path, log=lambda m: None, env=TWO, workers=2)
    return str(path)


def test_a_seed_fixes_the_scene_as_the_constructor_does_and_renders_the_same_frames():
    """reset(seed=s) is ``<task>-goal-observable(seed=s)``'s scene; the same seed and actions
    give the same frames, another seed (or an evaluation seed >= 2^32 whose low half is s)
    another scene."""
    _, classes, _ = import_metaworld()
    env = MetaWorldEnv("metaworld:push-v3", image_size=32)
    try:
        obs, info = env.reset(seed=11)
        assert info["task"] == "push-v3" and obs["state"].shape == (4,)
        reference = classes["push-v3-goal-observable"](seed=11)
        assert np.array_equal(env._task.sim._last_rand_vec, reference._last_rand_vec)
        reference.close()
        actions = np.random.default_rng(0).uniform(-1, 1, (3, 4)).astype(np.float32)
        runs = []
        for _ in range(2):
            obs, _ = env.reset(seed=11)
            frames = [obs["image"]] + [env.step(a)[0]["image"] for a in actions]
            runs.append(np.stack(frames))
        assert runs[0].shape == (4, 32, 32, 3) and runs[0].dtype == np.uint8
        assert np.array_equal(runs[0], runs[1])
        assert not np.array_equal(runs[0][0], runs[0][-1])  # the arm moved
        far = env.reset(seed=EVAL_SEED_BASE + 11)[0]["image"]
        assert not np.array_equal(far, runs[0][0])
        assert env.action_space.shape == (4,) and env_spec(TWO).action_dims == 4
    finally:
        env.close()


def test_instructions_hold_phrasings_out_in_known_words():
    """Every task has training phrasings and a held-out one; the held-out one is new as a
    sentence but every word of it is in the training phrasings (the tokenizer knows it)."""
    trained = {w for t in MT10_TASKS for p in phrasings(t, False) for w in p.split()}
    for task in MT10_TASKS:
        held, train = phrasings(task, True), phrasings(task, False)
        assert len(train) >= 2 and held and not set(held) & set(train)
        assert set(held) | set(train) == set(PHRASINGS[task])
        assert {w for p in held for w in p.split()} <= trained, task
    assert set(vocabulary()) == trained
    env = MetaWorldEnv("metaworld:reach-v3", image_size=16, held_out_instructions=True)
    try:
        assert env.reset(seed=1)[0]["instruction"] in phrasings("reach-v3", True)
    finally:
        env.close()


def test_bad_names_are_one_line():
    for name, message in [("metaworld:nosuch-v3", "unknown Meta-World task 'nosuch-v3'"),
                          ("metaworld:reach-v3+reach-v3", "names a task twice"),
                          ("metaworld", "unknown environment 'metaworld'")]:
        with pytest.raises(MeshtronError, match=message):
            make_env(name)
    env = make_env("metaworld:reach-v3", image_size=16)
    with pytest.raises(MeshtronError, match="not one of metaworld:reach-v3's"):
        env.reset(seed=0, options={"task": "push-v3"})
    with pytest.raises(MeshtronError, match="call reset"):
        env.step(np.zeros(4))


def test_a_missing_renderer_is_one_line():
    code = ("from meshtron.envs import make_env\n"
            "from meshtron.errors import MeshtronError\n"
            "try:\n    make_env('metaworld:reach-v3', image_size=16).reset(seed=0)\n"
            "except MeshtronError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "MUJOCO_GL": "nosuch"}, timeout=120)
    assert "renderer (MUJOCO_GL=nosuch) cannot start" in out.stdout, out.stderr[-2000:]
    assert "libegl1" in out.stdout and "Traceback" not in out.stdout + out.stderr


def test_evaluate_plans_tasks_and_refuses_another_action_space():
    """The rollout plan: the policy's own environment by default, ten episodes per MT10 task
    with held-out phrasings; a policy for 3-D actions is refused on a 4-D environment (and
    the reverse); two different episode counts are refused."""
    args = argparse.Namespace(env=None, episodes=None, episodes_per_task=None, video=None,
                              videos=8, max_steps=None, instructions="held-out")
    plan = rollout_plan(args, "metaworld-mt10", 4, Path("run"))
    assert plan.tasks == MT10_TASKS and plan.count == 10 and plan.env_name == "metaworld-mt10"
    assert plan.env_options == {"held_out_instructions": True}
    args.env, args.episodes_per_task, args.max_steps = TWO, 3, 50
    plan = rollout_plan(args, "metaworld-mt10", 4, Path("run"))
    assert plan.tasks == ("reach-v3", "push-v3") and plan.count == 3
    assert plan.env_options["max_steps"] == 50
    args.env = "metaworld-mt10"
    with pytest.raises(MeshtronError, match=r"^run holds a policy for tabletop \(3-D actions\); "
                                            r"metaworld-mt10 acts with 4-D actions$"):
        rollout_plan(args, "tabletop", 3, Path("run"))
    args.env = "tabletop"
    with pytest.raises(MeshtronError, match="tabletop acts with 3-D actions"):
        rollout_plan(args, "metaworld-mt10", 4, Path("run"))
    args.env, args.episodes = None, 5
    with pytest.raises(MeshtronError, match="--episodes 5 and --episodes-per-task 3 disagree"):
        rollout_plan(args, "metaworld-mt10", 4, Path("run"))


class ExpertTwinActor:
    """Plays a script per episode in a twin of its environment (the same task, seed and
    actions, so the same frames: asserted): the expert, the expert for its first 29 steps
    (push's is near the puck from step 28) and then up and away, or standing still.
    Episodes come one at a time (plan batch 1), in the plan's order."""

    def __init__(self, scripts: list[tuple[str, int, str]], max_steps: int):
        self.scripts = scripts
        self.twin = MetaWorldEnv(TWO, image_size=16, max_steps=max_steps)
        self.index, self.steps, self.image, self.state = -1, 0, None, None

    def __call__(self, images, instructions, states):
        if self.image is None:
            self.index += 1
            task, seed, _ = self.scripts[self.index]
            obs = self.twin.reset(seed=seed, options={"task": task})[0]
            self.image, self.state, self.steps = obs["image"], obs["state"], 0
        assert len(images) == 1 and np.array_equal(self.image, images[0])
        assert np.array_equal(self.state, states[0])  # the policy is handed the state
        kind = self.scripts[self.index][2]
        action = self.twin.expert_action()
        if kind == "still":
            action = np.zeros(4, dtype=np.float32)
        elif kind == "approach" and self.steps >= 29:
            action = np.array([0.0, -1.0, 1.0, -1.0], dtype=np.float32)
        obs, _, terminated, truncated, _ = self.twin.step(action)
        self.steps += 1
        self.image = None if terminated or truncated else obs["image"]
        self.state = obs["state"]
        return action[None, None, :]


def hand_made(scripts: list[tuple[str, int, str]], max_steps: int) -> list:
    tasks = tuple(dict.fromkeys(task for task, _, _ in scripts))
    plan = RolloutPlan(TWO, len(scripts) // len(tasks), tasks=tasks,
                       env_options={"max_steps": max_steps}, batch=1)
    actor = ExpertTwinActor(scripts, max_steps)
    try:
        return rollouts(actor, plan.count, 16, plan=plan)
    finally:
        actor.twin.close()


@pytest.mark.slow
def test_success_is_counted_per_task_with_the_failure_kinds():
    """Hand-made episodes: the expert succeeds at reach; standing still never gets near the
    puck; approaching it, then leaving, was near (once is enough) but not done. Success per
    task and the mean over tasks, episode lengths and each failure kind once."""
    episodes = hand_made([("reach-v3", EVAL_SEED_BASE, "expert")], 70)
    episodes += hand_made([("push-v3", EVAL_SEED_BASE, "still"),
                           ("push-v3", EVAL_SEED_BASE + 1, "approach")], 40)
    assert [e.outcome for e in episodes] == ["success", "never_near_object",
                                             "near_object_not_done"]
    assert [e.task for e in episodes] == ["reach-v3", "push-v3", "push-v3"]
    assert episodes[0].steps < 70 and episodes[0].episode_return > 0
    assert [e.steps for e in episodes[1:]] == [40, 40]
    summary = Evaluation(episodes, 0.5, 0.01, MetaWorldEnv.OUTCOMES).summary()
    assert summary["per_task"] == {"reach-v3": 1.0, "push-v3": 0.0}
    assert summary["success_rate"] == 0.5  # the mean over tasks, not over episodes (1/3)
    assert summary["outcomes"] == {"success": 1, "never_near_object": 1,
                                   "near_object_not_done": 1, "unstable": 0}
    assert summary["mean_episode_length"] == (episodes[0].steps + 80) / 3


@pytest.mark.slow
def test_vla_data_writes_successful_expert_episodes_of_each_task(mw_demos, tmp_path, capsys):
    dataset = EpisodeDataset.open(mw_demos)
    assert len(dataset) == 2 and dataset.action_dims == 4 and dataset.image_size == 32
    assert dataset.env == env_spec(TWO).dataset_env and tuple(dataset.words) == vocabulary()
    first, second = dataset[0], dataset[1]
    assert first.instruction in phrasings("reach-v3", False)
    assert second.instruction in phrasings("push-v3", False)
    assert first.success and second.success and 20 < len(first) < 200
    assert np.abs(dataset.actions).max() <= 1.0
    assert len(set(dataset.seeds)) == 2 and max(dataset.seeds) < 2**32  # eval seeds are above
    assert main(["vla-data", "--env", "metaworld:nosuch-v3", "--episodes", "1",
                 "--output", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "unknown Meta-World task 'nosuch-v3'" in err and "Traceback" not in err


def mw_overrides(demos: str, cache: str, run: str, steps: int) -> list[str]:
    return [*vla_overrides(demos, cache, run, steps=steps), f"--model.vision.env={TWO}",
            "--model.vision.action_dims=4"]


@pytest.mark.slow
def test_a_policy_trains_on_metaworld_frames_and_is_evaluated_per_task(mw_demos, tmp_path,
                                                                       capsys):
    run = tmp_path / "run"
    assert main(["train", *mw_overrides(mw_demos, str(tmp_path / "c"), str(run), 3)]) == 0
    out = tmp_path / "eval.json"
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(run), "--episodes-per-task", "1",
                 "--max-steps", "8", "--json", str(out), "--video", str(tmp_path / "v"),
                 "--videos", "1"]) == 0
    summary = json.loads(out.read_text())
    assert set(summary["per_task"]) == {"reach-v3", "push-v3"}
    assert summary["episodes"] == 2 == sum(summary["outcomes"].values())
    assert summary["success_rate"] == np.mean(list(summary["per_task"].values()))
    assert 1 <= summary["mean_episode_length"] <= 8
    assert len(list((tmp_path / "v").glob("*-v3-episode-*.gif"))) == 2
    for extra, message in [(["--env", "tabletop"], "tabletop acts with 3-D actions"),
                           (["--env", "metaworld:nosuch-v3"], "unknown Meta-World task")]:
        assert main(["evaluate", "--checkpoint", str(run), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    code = main(["train", *mw_overrides(mw_demos, str(tmp_path / "c"), str(tmp_path / "r2"), 1),
                 "--model.vision.env=tabletop", "--model.vision.action_dims=3"])
    err = capsys.readouterr().err
    assert code == 2 and "holds demonstrations of metaworld" in err


@pytest.mark.slow
def test_training_on_metaworld_frames_keeps_parity_under_tp_sp_pp_and_zero1(mw_demos, tmp_path):
    """The VLA parity machinery on Meta-World's 4-D actions and its proprioceptive state (the
    state token placed before the actions, its encoder replicated over tp): tp=2 with sp,
    pp=2 with both encoders on stage 0, dp=2 with ZeRO-1, each against one process (per-step
    loss and grad norm, fp32 at 1e-4 and fp64 at 1e-9), every layout checked."""
    from tests.distributed import run_distributed
    from tests.parity import assert_layouts_match_reference

    cache = str(tmp_path / "cache")
    extra = [f"--model.vision.env={TWO}", "--model.vision.action_dims=4",
             "--model.vision.state_dims=4",
             "--model.vision.instruction_len=9"]  # a window of 30: sp splits it over tp=2
    layouts = [["--parallel.tp=2", "--parallel.sp=true", *extra],
               ["--parallel.pp=2", "--train.micro_batch=2", *extra],
               ["--parallel.zero=1", *extra]]
    results = run_distributed(_vla_layouts, 2, mw_demos, cache, str(tmp_path), layouts)
    reference = run_layout(vla_overrides(mw_demos, cache, str(tmp_path / "ref")) + extra)
    assert reference["loss"][-1] < reference["loss"][0]
    assert_layouts_match_reference(reference, layouts, results)


@pytest.mark.slow
def test_states_of_a_set_written_without_them_are_recovered_by_replay(mw_demos, tmp_path):
    """Demonstrations record the hand's x, y, z and gripper opening per frame; a set written
    before they were (the same episodes, no states) gets exactly those back by replaying its
    episodes without rendering, and a replay that departs from the recording is refused."""
    from meshtron.data.episodes import Episode, write_episodes
    from meshtron.data.metaworld_states import add_states

    dataset = EpisodeDataset.open(mw_demos)
    assert dataset.state_dims == 4 and dataset.states is not None
    bare = [Episode(e.images, e.actions, e.instruction, e.seed, e.success)
            for e in map(dataset.__getitem__, range(len(dataset)))]
    old = write_episodes(tmp_path / "old", bare, env=dataset.env, words=dataset.words)
    assert EpisodeDataset.open(old).state_dims == 0
    add_states(old, TWO, 5, log=lambda m: None)
    assert np.array_equal(EpisodeDataset.open(old).states, dataset.states)
    bare[0].actions[3, 0] += 0.01
    write_episodes(tmp_path / "bent", bare, env=dataset.env, words=dataset.words)
    with pytest.raises(MeshtronError, match="departs from the recording at step 3"):
        add_states(tmp_path / "bent", TWO, 5, log=lambda m: None)
