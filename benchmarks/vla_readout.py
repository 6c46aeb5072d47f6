"""Which readout of the vision encoder learns the motion: the decoder, or a head on the patches.

Run from the repository root::

    .venv/bin/python benchmarks/vla_readout.py [--blocks 1] [--episodes 2000] [--steps 500]
        [--bins 8] [--readouts decoder,mlp,mlp-norm] [--json OUT]

Not speed: a diagnosis of docs/vla.md's unmet success goal. It generates expert demonstrations
of the tabletop task (``--blocks 1``: one block, so the instruction says nothing the image does
not and no colour has to be bound), builds tiny-vla (configs/vla.yaml, ``--bins`` action bins)
and trains, for each readout, the same freshly initialised encoder on the same batches with
cross-entropy over the action bins (AdamW, constant lr, one thread):

- ``decoder``: the policy as meshtron trains it, image tokens -> decoder -> action tokens;
- ``mlp``: the encoder's patch outputs flattened (each patch at its own input position) into a
  two-layer GELU MLP that outputs the three action dimensions' bins;
- ``mlp-norm``: the same MLP with one more linear layer into the decoder's width and an
  RMSNorm before its last layer (the decoder normalises every read of a token).

Every 100 steps it prints the validation action-token accuracy per dimension and how often the
predicted dx and dy have the expert's sign (chance is about 50%).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from meshtron.config import Config, load_config
from meshtron.config.kinds import VISION
from meshtron.data.builders import row_format
from meshtron.data.demonstrations import generate_demonstrations
from meshtron.data.vla_data import VLATrainingData, build_policy_data
from meshtron.models.init import initialize
from meshtron.models.transformer import WHOLE_MODEL, Transformer
from meshtron.parallel.context.sequence import SequenceSplit
from meshtron.parallel.mesh.groups import ParallelMesh

READOUTS = ("decoder", "mlp", "mlp-norm")


class PatchHead(nn.Module):
    """The encoder's flattened patch outputs -> [b, action_dims, bins] logits."""

    def __init__(self, vision: nn.Module, width: int, patches: int, dims: int, bins: int,
                 norm: bool):
        super().__init__()
        self.vision, self.dims, self.bins = vision, dims, bins
        layers: list[nn.Module] = [nn.Linear(width * patches, 256), nn.GELU()]
        if norm:
            layers += [nn.Linear(256, width), nn.RMSNorm(width), nn.Linear(width, dims * bins)]
        else:
            layers += [nn.Linear(256, dims * bins)]
        self.head = nn.Sequential(*layers)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.vision(images).flatten(1)).view(-1, self.dims, self.bins)


def train_readout(readout: str, cfg: Config, data: VLATrainingData, steps: int, lr: float,
                  log: Callable[[str], object]) -> list[dict]:
    """Train ``readout`` from a fresh initialisation; its held-out rows every 100 steps."""
    torch.manual_seed(0)
    model = Transformer(cfg.model, ParallelMesh.single(), WHOLE_MODEL)
    initialize(model, seed=0, std=cfg.model.init_std, num_layers=cfg.model.num_layers)
    v = cfg.model.vision
    first, bins, dims = data.codec.first_id, v.action_bins, v.action_dims
    net: nn.Module = model
    if readout != "decoder":
        net = PatchHead(model.vision, cfg.model.hidden_size, v.num_patches, dims, bins,
                        norm=readout == "mlp-norm")
    split = SequenceSplit(ParallelMesh.single().cp, rows=row_format(cfg.model))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)

    def logits_and_targets(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mb = split(rows)
        keep = mb.targets >= 0
        targets = mb.targets[keep].view(-1, dims) - first
        if readout == "decoder":
            logits = model(mb.tokens, inputs=mb.inputs)[keep][:, first:first + bins]
            return logits.reshape(-1, dims, bins), targets
        return net(mb.inputs[VISION]), targets

    valid = data.valid.rows(np.arange(min(len(data.valid), 512)))
    rows = []
    for step in range(steps + 1):
        if step % 100 == 0:
            with torch.no_grad():
                logits, targets = logits_and_targets(valid)
            predicted = logits.argmax(-1)
            want = data.codec.decode((targets + first).numpy())[:, :2]
            got = data.codec.decode((predicted + first).numpy())[:, :2]
            row = dict(readout=readout, step=step,
                       accuracy=[round(float(a), 3)
                                 for a in (predicted == targets).float().mean(0)],
                       sign=[round(float(a), 3) for a in
                             (np.sign(want.round(2)) == np.sign(got.round(2))).mean(0)])
            log(f"{readout:9s} step {step:5d} | token accuracy per dim {row['accuracy']} | "
                f"dx, dy sign right {row['sign']}")
            rows.append(row)
        if step == steps:
            break
        logits, targets = logits_and_targets(data.train_batch(step, cfg.train.global_batch))
        loss = nn.functional.cross_entropy(logits.reshape(-1, bins), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--bins", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--readouts", default=",".join(READOUTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = generate_demonstrations(args.episodes, 0, 32, Path(tmp) / "demos", print,
                                       num_blocks=args.blocks)
        cfg = load_config("configs/vla.yaml", [f"--model.vision.action_bins={args.bins}",
                                               f"--data.path={path}"])
        data = build_policy_data(cfg, print)
    cfg = data.resolved(cfg)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, vocab_size=data.tokenizer.vocab_size))
    results = [row for readout in args.readouts.split(",")
               for row in train_readout(readout, cfg, data, args.steps, args.lr, print)]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
