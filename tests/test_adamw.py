"""meshtron's AdamW is torch's update, bit for bit, without importing torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import torch

from meshtron.config import load_config
from meshtron.optim.adamw import EagerAdamW, build_adamw


def test_the_update_and_state_are_torchs_bit_for_bit():
    torch.manual_seed(0)
    ours_model, torch_model = torch.nn.Linear(6, 5), torch.nn.Linear(6, 5)
    torch_model.load_state_dict(ours_model.state_dict())
    ours = build_adamw(ours_model, load_config(overrides=["--train.weight_decay=0.1"]).train)
    assert isinstance(ours, EagerAdamW)
    theirs = torch.optim.AdamW(
        [{"params": [torch_model.weight], "weight_decay": 0.1},
         {"params": [torch_model.bias], "weight_decay": 0.0}], lr=ours.defaults["lr"],
        betas=ours.defaults["betas"], eps=ours.defaults["eps"], foreach=True)
    for step in range(3):
        x = torch.randn(4, 6)
        for model, optimizer in ((ours_model, ours), (torch_model, theirs)):
            optimizer.zero_grad()
            model(x).square().sum().backward()
            optimizer.step()
        assert torch.equal(ours_model.weight, torch_model.weight), step
        assert torch.equal(ours_model.bias, torch_model.bias), step
    state = ours.state_dict()
    assert torch.equal(state["state"][0]["exp_avg"], theirs.state_dict()["state"][0]["exp_avg"])
    ours.load_state_dict(theirs.state_dict())
    assert ours_model.weight.grad is not None and (ours.zero_grad() or True)
    assert ours_model.weight.grad is None


def test_building_and_stepping_it_leaves_torch_dynamo_unimported():
    code = ("import sys, torch\n"
            "from meshtron.config import load_config\n"
            "from meshtron.optim.adamw import build_adamw\n"
            "m = torch.nn.Linear(3, 2)\n"
            "o = build_adamw(m, load_config(overrides=[]).train)\n"
            "m(torch.ones(1, 3)).sum().backward(); o.step(); o.load_state_dict(o.state_dict())\n"
            "o.zero_grad(); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
