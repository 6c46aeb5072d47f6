"""``meshtron evaluate``: a vision-language-action policy in closed loop (its data is written by
``meshtron vla-data``, :mod:`meshtron.data.vla_data_command`).

The checkpoint, its config and its tokenizer are checked before the model is built; a text
model's checkpoint is refused in one line. The held-out demonstrations the accuracy is measured
on are the validation episodes of the data the policy was trained on (its config's
``data.path``, or the default demonstrations).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from meshtron.checkpoint.loading import load_model, open_for_inference
from meshtron.data.vla_data import build_policy_data
from meshtron.data.vla_tokens import ActionCodec
from meshtron.envs import DEFAULT_ENV, check_env_name, env_spec, make_env, save_gif
from meshtron.errors import MeshtronError
from meshtron.files import check_writable
from meshtron.inference.policy_eval import (
    Episode,
    Evaluation,
    PolicyActor,
    RolloutPlan,
    evaluate_policy,
)
from meshtron.models.policy_runner import PolicyRunner


def episodes_per_task(args: argparse.Namespace, tasks: int) -> int:
    """--episodes or --episodes-per-task (not two different counts), else the default."""
    given = {n for n in (args.episodes, args.episodes_per_task) if n is not None}
    if len(given) > 1:
        raise MeshtronError(f"--episodes {args.episodes} and --episodes-per-task "
                            f"{args.episodes_per_task} disagree; give one")
    count = given.pop() if given else (100 if tasks == 1 else 10)
    if count < 1:
        raise MeshtronError(f"--episodes-per-task must be at least 1, got {count}")
    return count


def rollout_plan(args: argparse.Namespace, trained_env: str, action_dims: int,
                 path: Path) -> RolloutPlan:
    """What to roll out, checked against the policy: its action space must be the
    environment's."""
    name = args.env or trained_env
    spec = env_spec(name)
    if spec.action_dims != action_dims:
        raise MeshtronError(f"{path} holds a policy for {trained_env} ({action_dims}-D actions); "
                            f"{name} acts with {spec.action_dims}-D actions")
    count = episodes_per_task(args, len(spec.tasks))
    options = {} if args.max_steps is None else {"max_steps": args.max_steps}
    keep = args.videos if args.video else 0
    if name == DEFAULT_ENV:
        return RolloutPlan(name, count, env_options=options, keep_frames=keep)
    options["held_out_instructions"] = args.instructions == "held-out"
    return RolloutPlan(name, count, tasks=spec.tasks, env_options=options, keep_frames=keep)


def probe_env(plan: RolloutPlan, image_size: int) -> None:
    """Build and reset one environment before the model loads, so that a missing renderer
    is one line at once."""
    env = make_env(plan.env_name, image_size=image_size, **plan.env_options)
    try:
        env.reset(seed=0, options=None if plan.tasks[0] is None else {"task": plan.tasks[0]})
    finally:
        env.close()


def episode_line(total: int) -> Callable[[list[Episode]], None]:
    """A progress line on stderr after every batch of episodes, when stderr is a terminal."""
    def show(done: list[Episode]) -> None:
        if sys.stderr.isatty():
            wins = sum(e.success for e in done)
            sys.stderr.write(f"\revaluate: {len(done)}/{total} episodes, {wins} succeeded, "
                             f"last task {done[-1].task} \033[K")
            sys.stderr.flush()
            if len(done) == total:
                sys.stderr.write("\r\033[K")
    return show


def run_evaluate(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise MeshtronError(f"evaluate takes no config overrides, got {' '.join(extra)}")
    for flag in ("episodes", "episodes_per_task", "max_steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise MeshtronError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.env:
        check_env_name(args.env)
    if args.json:
        check_writable(Path(args.json).parent, "--json's folder")
    if args.video:
        check_writable(Path(args.video), "--video")
    ckpt = open_for_inference(Path(args.checkpoint))
    cfg = ckpt.config
    vision = cfg.model.vision
    if not vision.enabled:
        raise MeshtronError(f"{ckpt.path} is a text model's checkpoint; meshtron evaluate "
                            "rolls out vision-language-action policies (model.vision)")
    plan = rollout_plan(args, vision.env, vision.action_dims, ckpt.path)
    probe_env(plan, vision.image_size)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = load_model(ckpt, dtype="fp32")
    codec = ActionCodec.of(ckpt.tokenizer, vision.action_low, vision.action_high,
                           vision.action_bins)
    actor = PolicyActor(PolicyRunner(model, codec.first_id), codec, ckpt.tokenizer)
    data = build_policy_data(cfg, tokenizer=ckpt.tokenizer)
    total = plan.count * len(plan.tasks)
    result = evaluate_policy(actor, data, plan.count, plan=plan, progress=episode_line(total))
    report(result, plan, args)
    return 0


def report(result: Evaluation, plan: RolloutPlan, args: argparse.Namespace) -> None:
    """The summary lines, the videos and the JSON."""
    summary = result.summary()
    print(f"success rate {100 * result.success_rate:.1f}% over {len(result.episodes)} "
          f"held-out episodes of {plan.env_name}, mean episode length "
          f"{result.mean_length:.1f} steps, mean return {result.mean_return:.3f}, action-token "
          f"accuracy {100 * result.action_token_accuracy:.1f}%, {1000 * result.latency_s:.1f} "
          f"ms per control step ({summary['control_steps_per_s']:.1f} steps/s)")
    if len(result.per_task) > 1:
        for task, rate in result.per_task.items():
            print(f"  {task}: {100 * rate:.1f}%")
    failures = {k: n for k, n in result.outcomes.items() if k != "success"}
    print("failures: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in failures.items()))
    if args.video:
        for index, episode in enumerate(e for e in result.episodes if e.frames):
            outcome = "success" if episode.success else episode.outcome.replace("_", "-")
            name = f"episode-{index:03d}-{outcome}.gif"
            if plan.tasks[0] is not None:
                name = f"{episode.task}-{name}"
            path = save_gif(episode.frames, Path(args.video) / name)
            print(f"{path}: {episode.instruction!r}, {outcome} in {episode.steps} steps")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
