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
from pathlib import Path

import torch

from meshtron.checkpoint.loading import load_model, open_for_inference
from meshtron.data.vla_data import build_policy_data
from meshtron.data.vla_tokens import ActionCodec
from meshtron.envs import save_gif
from meshtron.errors import MeshtronError
from meshtron.files import check_writable
from meshtron.inference.policy_eval import PolicyActor, evaluate_policy
from meshtron.models.policy_runner import PolicyRunner


def run_evaluate(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise MeshtronError(f"evaluate takes no config overrides, got {' '.join(extra)}")
    if args.episodes < 1:
        raise MeshtronError(f"--episodes must be at least 1, got {args.episodes}")
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
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = load_model(ckpt, dtype="fp32")
    codec = ActionCodec.of(ckpt.tokenizer, vision.action_low, vision.action_high,
                           vision.action_bins)
    actor = PolicyActor(PolicyRunner(model, codec.first_id), codec, ckpt.tokenizer)
    data = build_policy_data(cfg, tokenizer=ckpt.tokenizer)
    kept = args.videos if args.video else 0
    result = evaluate_policy(actor, data, args.episodes, keep_frames=kept)
    summary = result.summary()
    print(f"success rate {100 * result.success_rate:.1f}% over {len(result.episodes)} "
          f"held-out episodes, mean return {result.mean_return:.3f}, action-token accuracy "
          f"{100 * result.action_token_accuracy:.1f}%, {1000 * result.latency_s:.1f} ms per "
          f"control step ({summary['control_steps_per_s']:.1f} steps/s)")
    failures = {k: n for k, n in result.outcomes.items() if k != "success"}
    print("failures: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in failures.items())
          + " (closed over another block, over bare table, not closed in time)")
    if args.video:
        for index, episode in enumerate(result.episodes[:kept]):
            outcome = "success" if episode.success else "failure"
            path = save_gif(episode.frames, Path(args.video) / f"episode-{index:03d}-"
                            f"{outcome}.gif")
            print(f"{path}: {episode.instruction!r}, {outcome} in {episode.steps} steps")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0
