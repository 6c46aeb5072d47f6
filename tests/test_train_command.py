"""The commands as modules: cli.py's table is the whole command line, and ``meshtron train``
makes each start-up check once per process (the plan once the tokenizer is known)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Callable

from meshtron import cli
from meshtron.costmodel.online import running_prices
from meshtron.plan import check_run, plan_run
from meshtron.training import train_command, trainer  # noqa: F401  (bound names to count)
from meshtron.training.memory import check_state_fits
from meshtron.training.run_dir import check_run_dir
from tests.parity import test_overrides


def test_the_table_is_the_command_line():
    """Every command of ``meshtron --help`` comes from one entry of ``cli.COMMANDS``, in its
    order, and runs a function of the package that adds its parser (not of cli.py)."""
    subparsers = cli.build_parser()._subparsers._group_actions[0].choices
    assert list(subparsers) == list(cli.COMMANDS)
    for name, add_parser in cli.COMMANDS.items():
        func = subparsers[name].get_default("func")
        package = add_parser.__module__.rsplit(".", 1)[0]
        assert func.__module__.startswith(package + "."), (name, func.__module__)


def test_the_command_line_is_built_without_the_heavy_libraries(tmp_path):
    """``meshtron --help`` builds every command's parser, so no command module (nor the
    package holding it) may import torch, numpy or tokenizers at import time."""
    script = ("import sys\n"
              "from meshtron.cli import build_parser\n"
              "build_parser()\n"
              "print(sorted({'torch', 'numpy', 'tokenizers'} & set(sys.modules)))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.split() == ["[]"], proc.stdout + proc.stderr


def count_calls(monkeypatch, *functions: Callable) -> Counter:
    """Count the calls of ``functions`` wherever a meshtron module holds them by name."""
    counts: Counter = Counter()
    for function in functions:
        def counted(*args, _function=function, **kwargs):
            counts[_function.__name__] += 1
            return _function(*args, **kwargs)

        for module in [m for n, m in sys.modules.items() if n.startswith("meshtron")]:
            for name, value in list(vars(module).items()):
                if value is function:
                    monkeypatch.setattr(module, name, counted)
    return counts


def test_each_start_up_check_runs_once_per_process(data_cache, tmp_path, monkeypatch, capsys):
    """One process, the whole start: the layout checked once before the tokenizer exists, the
    plan built once after it, the run directory, the memory and the tuner's profile once."""
    counts = count_calls(monkeypatch, check_run, plan_run, check_run_dir, check_state_fits,
                         running_prices)
    args = ["train", *test_overrides(data_cache, str(tmp_path / "run"), steps=1)]
    assert cli.main(args) == 0, capsys.readouterr().err
    assert counts == {"check_run": 1, "plan_run": 1, "check_run_dir": 1, "check_state_fits": 1,
                      "running_prices": 1}
