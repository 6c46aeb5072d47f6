"""archsearch says what its proxy runs will cost before they start, how long the rest will
take after each, and stops at ``--max-minutes`` (a clock injected, so no test waits on a real
one): no proxy starts after the bound, the running one is given only what is left, and the
fit answers from what finished."""

from __future__ import annotations

import pytest

from meshtron.archsearch import proxy_runs
from meshtron.archsearch.proxy_rounds import fit_results
from meshtron.archsearch.shapes import Shape
from meshtron.config import load_config
from meshtron.errors import MeshtronError
from tests.test_archsearch import TINY, archsearch, assert_one_line

PROXIES = [proxy_runs.Proxy(Shape(layers, 32, 2, 2, 96), float(layers), 12, 1e6)
           for layers in (1, 2, 3)]


class SteppingClock:
    """A clock that each proxy run advances by ``run_s`` seconds."""

    def __init__(self, run_s: float):
        self.now, self.run_s, self.timeouts = 0.0, run_s, []

    def __call__(self) -> float:
        return self.now

    def start_trial(self, config_path, nproc, log_path, timeout_s, env=None):
        self.timeouts.append(timeout_s)
        self.now += self.run_s
        return "exit 1: stopped by the test"


def test_no_proxy_starts_after_max_minutes_and_the_running_one_gets_what_is_left(
        monkeypatch, tmp_path, capsys):
    clock = SteppingClock(run_s=45.0)
    monkeypatch.setattr(proxy_runs, "start_trial", clock.start_trial)
    cfg = load_config(overrides=TINY)
    results = proxy_runs.run_proxies(cfg, PROXIES, tmp_path, 1, 3, timeout_s=1800.0,
                                     deadline=proxy_runs.Deadline(1.0, clock))
    # started at 0 s and 45 s (under the minute), the third would start at 90 s
    assert len(results) == 2 and clock.timeouts == [60.0, 15.0]
    err = capsys.readouterr().err
    assert "--max-minutes 1 reached: 2 of 3 proxy runs done" in err


def test_without_a_bound_every_proxy_runs():
    assert proxy_runs.Deadline(None).left() == float("inf")


def test_nothing_finished_by_the_bound_is_one_line():
    with pytest.raises(MeshtronError, match="--max-minutes passed before any proxy run"):
        fit_results([])


def test_the_plan_line_and_the_progress_line_count_what_is_left():
    tokens = 8 * 32
    line = proxy_runs.plan_line(PROXIES, tokens)
    flops = sum(p.steps * tokens * p.flops_per_token for p in PROXIES)
    assert line.startswith("planned: 3 proxy runs (") and f"{flops:.3g} FLOPs" in line
    minutes = (flops / proxy_runs.FLOPS_PER_S + 3 * proxy_runs.START_S) / 60
    assert f"about {minutes:.1f} min" in line
    # the first run took 15 s beyond its start-up: the other two at its rate
    cost = PROXIES[0].steps * tokens * PROXIES[0].flops_per_token
    done = [(cost, proxy_runs.START_S + 15.0)]
    progress = proxy_runs.progress_line("proxy 1/3", done, PROXIES[1:], tokens)
    left = sum(15.0 * p.steps * p.flops_per_token / (PROXIES[0].steps * PROXIES[0]
                                                      .flops_per_token) + proxy_runs.START_S
               for p in PROXIES[1:])
    assert progress == f"proxy 1/3: done in 30 s; about {left / 60:.1f} min left for the other 2"


def test_max_minutes_must_be_positive(capsys):
    code, _, err = archsearch(capsys, "--budget-flops", "1e11", *TINY, "--layers", "1,2",
                              "--widths", "32,64", "--proxies", "2", "--proxy-steps", "12",
                              "--max-minutes", "0")
    assert_one_line(code, err, "--max-minutes must be a positive number of minutes, got 0")


# ----------------------------------------------------------------------------- hpsearch


def test_hpsearch_starts_no_trial_after_max_minutes(monkeypatch, tmp_path, capsys):
    from meshtron.cli import main
    from meshtron.hpsearch import loop
    from meshtron.tune.deadline import Deadline

    readings = iter([0.0, 61.0])  # the bound is set at 0 s; the first check reads 61 s
    monkeypatch.setattr(loop, "Deadline",
                        lambda minutes: Deadline(minutes, lambda: next(readings)))
    monkeypatch.setattr(loop, "run_watched", lambda *a, **k: pytest.fail("a trial started"))
    monkeypatch.chdir(tmp_path)
    code = main(["hpsearch", "--model.preset=tiny", "--model.vocab_size=512", "--trials", "3",
                 "--max-minutes", "1", "--json", str(tmp_path / "hp.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert "hpsearch: --max-minutes 1 reached after 0 of 3 trials" in err
    assert "no trial completed (0 ran" in err.strip().splitlines()[-1]


def test_hpsearch_max_minutes_must_be_positive(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from meshtron.cli import main

    assert main(["hpsearch", "--model.preset=tiny", "--model.vocab_size=512",
                 "--max-minutes", "-1"]) == 2
    assert "--max-minutes must be a positive number of minutes, got -1" in \
        capsys.readouterr().err


def test_proxy_cost_is_sub_linear_in_the_budget():
    from meshtron.archsearch.proxy_rounds import PROXY_REFERENCE_FLOPS, proxy_flops_of

    small = proxy_flops_of(PROXY_REFERENCE_FLOPS, 0.25)
    assert small == 0.25 * PROXY_REFERENCE_FLOPS == proxy_flops_of(
        PROXY_REFERENCE_FLOPS / 2, 0.25) * 2  # a quarter of a small budget, as before
    # 100x the budget buys proxies 10x as long
    assert proxy_flops_of(100 * PROXY_REFERENCE_FLOPS, 0.25) == pytest.approx(10 * small)
    assert proxy_flops_of(4e12, 0.25) < 4e12 * 0.25 / 6


def test_a_proxys_steps_follow_the_sub_linear_budget():
    from meshtron.archsearch.proxy_rounds import ProxySettings, proxy_flops_of, proxy_of
    from meshtron.archsearch.shape_cost import budget_of

    cfg = load_config(overrides=TINY)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    for flops in (1e10, 4e12):
        proxy = proxy_of(cfg, ProxySettings(), budget_of(flops, None, None, "fp32"),
                         PROXIES[1].shape, 1.0)
        assert isinstance(proxy, proxy_runs.Proxy), proxy
        assert proxy.steps == int(proxy_flops_of(flops, 0.25) / proxy.flops_per_token
                                  // tokens)
