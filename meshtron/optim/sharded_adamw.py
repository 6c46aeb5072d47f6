"""AdamW over this rank's shard of every gradient bucket (the distributed optimizer, ZeRO-1/2/3).

A rank keeps fp32 master weights (fp64 in fp64 runs) and both Adam moments only for its 1/dp
shard of each bucket's flat parameters (:class:`FlatParams`), updates that shard from its
reduce-scattered gradient, and hands it back to the flat parameters (which all-gather it under
ZeRO-1/2). Parameters already in the master dtype are their own master: the shard is updated in
place, with no second copy (FSDP2 keeps none either). The update is element for element the
one of ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected moments), at the scheduled
rate times each bucket's ``lr_mult`` (muP; a bucket never mixes multipliers), as torch's param
groups of ZeRO-0 apply it.
"""

from __future__ import annotations

import math

import torch

from meshtron.config import TrainConfig
from meshtron.optim.flat_params import FlatParams
from meshtron.optim.grad_buckets import GradReducer
from meshtron.precision.policy import at_least_fp32

MOMENTS = ("exp_avg", "exp_avg_sq")


class ShardedAdamW:
    def __init__(self, reducer: GradReducer, flats: list[FlatParams], t: TrainConfig):
        self.reducer = reducer
        self.flats = flats
        self.t = t
        self.steps = 0
        self.master = [flat.shard if flat.shard.dtype == at_least_fp32(flat.shard.dtype)
                       else flat.shard.to(at_least_fp32(flat.shard.dtype), copy=True)
                       for flat in flats]
        self.moments = [{k: torch.zeros_like(m) for k in MOMENTS} for m in self.master]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        t = self.t
        self.steps += 1
        bias1 = 1 - t.beta1**self.steps
        bias2_sqrt = math.sqrt(1 - t.beta2**self.steps)
        works = []
        for bucket, flat, master, moments in zip(self.reducer.buckets, self.flats, self.master,
                                                 self.moments):
            grad = self.reducer.local_grad(bucket).to(master.dtype)
            rate = lr * bucket.lr_mult if bucket.lr_mult != 1.0 else lr
            if bucket.decay and t.weight_decay:  # muP: lr x wd as the base's (see adamw.py)
                decay = t.weight_decay / bucket.lr_mult if bucket.lr_mult != 1.0 else t.weight_decay
                master.mul_(1 - rate * decay)
            exp_avg, exp_avg_sq = moments["exp_avg"], moments["exp_avg_sq"]
            exp_avg.lerp_(grad, 1 - t.beta1)
            exp_avg_sq.mul_(t.beta2).addcmul_(grad, grad, value=1 - t.beta2)
            denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(t.eps)
            master.addcdiv_(exp_avg, denom, value=-rate / bias1)
            if master is not flat.shard:
                flat.shard.copy_(master)
            works.append(flat.after_update())
        for work in works:
            if work is not None:
                work.wait()

    # ------------------------------------------------------------------ checkpoints

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state on this rank: fp32 master weights kept beside the
        parameters, and the two moments."""
        moments = [m for ms in self.moments for m in ms.values()]
        masters = [m for m, flat in zip(self.master, self.flats) if m is not flat.shard]
        return {"master": sum(t.numel() * t.element_size() for t in masters),
                "optimizer": sum(t.numel() * t.element_size() for t in moments)}
