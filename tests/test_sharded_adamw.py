"""The distributed optimizer's AdamW (fp32 masters and moments over bucket chunks) against
``torch.optim.AdamW`` given the very gradients it was given, step by step.

bf16 parameters on one rank run :class:`ShardedAdamW` over whole buckets: every update of a
mixed-precision or ZeRO run goes through it, and the parity tests would only see a wrong
update as a drift they share with the one-process reference, which runs it too.
"""

from __future__ import annotations

import torch

from meshtron.config import load_config
from meshtron.optim.data_parallel import ShardedOptimizer
from meshtron.training.trainer import Trainer


def test_each_bucket_is_updated_as_torch_adamw_updates_its_master(tiny_overrides):
    trainer = Trainer(load_config(overrides=tiny_overrides + [
        "--precision.dtype=bf16", "--train.steps=2", "--train.global_batch=2",
        "--model.num_layers=1", "--model.hidden_size=32", "--model.ffn_hidden_size=64",
        "--train.seq_len=16"]),
        log=lambda m: None)
    optimizer = trainer.optimizer
    assert isinstance(optimizer, ShardedOptimizer)
    adamw, t = optimizer.adamw, trainer.cfg.train
    twins = [master.detach().clone().requires_grad_() for master in adamw.master]
    reference = torch.optim.AdamW(
        [{"params": [twin], "weight_decay": t.weight_decay if bucket.decay else 0.0}
         for twin, bucket in zip(twins, optimizer.reducer.buckets, strict=True)],
        lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    real_update, rates = optimizer.update, []

    def update(lr: float) -> None:
        """The reference takes the gradients as clipped, then the optimizer steps."""
        for twin, bucket in zip(twins, optimizer.reducer.buckets, strict=True):
            twin.grad = optimizer.reducer.local_grad(bucket).float().clone()
        for group in reference.param_groups:
            group["lr"] = lr
        reference.step()
        rates.append(lr)
        real_update(lr)

    optimizer.update = update
    trainer.run()
    assert len(rates) == 2 and optimizer.steps_taken == 2
    for twin, master, moments in zip(twins, adamw.master, adamw.moments, strict=True):
        state = reference.state[twin]
        torch.testing.assert_close(moments["exp_avg"], state["exp_avg"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(moments["exp_avg_sq"], state["exp_avg_sq"], rtol=1e-6,
                                   atol=1e-12)
        torch.testing.assert_close(master, twin.detach(), rtol=1e-6, atol=1e-7)
