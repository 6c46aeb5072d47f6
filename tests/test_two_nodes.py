"""Two "nodes" on one machine: network namespaces joined by a veth pair, 2-rank nodes meeting
over torchrun's c10d rendezvous. When one node's link is cut, the other must notice within
``run.timeout_s`` and exit with a line naming the ranks it lost (the hang watchdog), not hang;
when a node joins a job running on the other alone, the run must continue on 4 ranks with the
losses of an uninterrupted run. Skipped, saying why, where namespaces cannot be made (not root,
no ``ip``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.parity import run_training, test_overrides
from tests.test_cli import _JOB_VARIABLES

TIMEOUT_S = 6
"""The watchdog's wait in the cut-link test, which the test spends waiting after the cut: 200
tiny steps' time (~0.03 s each), started only once step 5 is logged."""
STEP_5 = re.compile(r"^step +5/", re.MULTILINE)
GATED = "import sys, torch.distributed.run as run; sys.stdin.readline(); run.main(sys.argv[1:])"
"""torchrun, started when a line arrives on stdin."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_nodes():
    """(namespace, interface, address) of each node; removed afterwards."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need root and iproute2's `ip`")
    tag = f"{os.getpid() % 100000}"
    nodes = [(f"mtn{tag}a", f"mv{tag}a", "10.77.0.1"), (f"mtn{tag}b", f"mv{tag}b", "10.77.0.2")]
    try:
        for namespace, _, _ in nodes:
            _ip("netns", "add", namespace)
        _ip("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])
        for namespace, interface, address in nodes:
            _ip("link", "set", interface, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as err:
        for namespace, _, _ in nodes:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {err.stderr.strip()}")
    yield nodes
    for namespace, _, _ in nodes:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _node(node: int, nodes, args: list[str], out: Path, nnodes: str = "2", rdzv_conf: str = "",
          launcher: tuple[str, ...] = (), gated: bool = False,
          extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Node ``node``'s torchrun (2 ranks; ``launcher``: more torchrun options). ``gated``:
    torch is imported, and the agent starts when a line arrives on stdin (a node joins
    within a second of it, not after an import)."""
    namespace, interface, address = nodes[node]
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARIABLES and not k.startswith(("SLURM_", "MESHTRON_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=interface, **(extra_env or {}))
    run = ["-c", GATED] if gated else ["-m", "torch.distributed.run"]
    command = ["ip", "netns", "exec", namespace, sys.executable, *run, *launcher,
               "--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{nodes[0][2]}:29555", "--rdzv-id", "two-nodes",
               "--rdzv-conf", f"is_host={str(node == 0).lower()}{rdzv_conf}",
               "--local-addr", address, "-m", "meshtron", "train", *args]
    return subprocess.Popen(command, stdout=open(out, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            stdin=subprocess.PIPE if gated else None, env=env,
                            start_new_session=True, text=True)


def _stop(procs: list[subprocess.Popen], run: Path) -> None:
    """Kill what is left: the agents start their ranks in sessions of their own, so the ranks
    are found by their run.dir."""
    for proc in procs:
        subprocess.run(["pkill", "-9", "-s", str(proc.pid)], capture_output=True)
    subprocess.run(["pkill", "-9", "-f", str(run)], capture_output=True)
    for proc in procs:
        proc.wait()


def _wait_for(pattern: re.Pattern, log: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pattern.search(log.read_text()) and time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-2000:]
        time.sleep(0.2)
    assert pattern.search(log.read_text()), f"no {pattern.pattern!r}: {log.read_text()[-2000:]}"


@pytest.mark.slow
def test_a_cut_link_is_detected_by_the_other_node_within_the_timeout(data_cache, tmp_path,
                                                                     two_nodes):
    args = test_overrides(data_cache, str(tmp_path / "run"), 100_000) + [
        "--train.log_every=1", f"--run.timeout_s={TIMEOUT_S}", "--checkpoint.every=0"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    procs = [_node(0, two_nodes, args, logs[0]), _node(1, two_nodes, args, logs[1])]
    try:
        _wait_for(STEP_5, logs[0], procs[0], 180)
        _ip("-n", two_nodes[1][0], "link", "set", two_nodes[1][1], "down")
        cut = time.monotonic()
        procs[0].wait(timeout=TIMEOUT_S + 90)
        detected = time.monotonic() - cut
    finally:
        _stop(procs, tmp_path / "run")
    text = logs[0].read_text()
    lines = [line for line in text.splitlines() if line.startswith("meshtron: error: rank ")]
    assert lines, text[-3000:]
    assert any(("unresponsive: rank 2" in line or "unresponsive: rank 3" in line)
               and f"(run.timeout_s={TIMEOUT_S})" in line for line in lines), lines
    assert procs[0].returncode != 0 and detected < TIMEOUT_S + 60, detected


GROW_STEPS = 10
STEP_3 = re.compile(r"^step +3/", re.MULTILINE)
GROW_ENV = {"MESHTRON_FAULTS": "slow:seconds=0.5", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Every step takes 0.5 s longer, so A is still training when B has joined (a tiny step takes
~0.03 s; B joins within one step of the go). Without a shared agent store (torch 2.13's c10d
handler gives a node that joins no address when the rank-0 node stays: it times out after
60 s), the workers' rank 0 hosts each round's store."""


@pytest.mark.slow
def test_a_node_that_joins_grows_the_run_with_the_same_losses(data_cache, tmp_path, two_nodes):
    """Node A trains alone on 2 ranks under ``--nnodes 1:2``, loses rank 1 at step 3 and
    restarts (its agent's restart count is now 1); node B (count 0) joins after that. The
    agents start the group on 4 ranks, which meet although their counts differ, resume from
    the newest checkpoint resharded from dp=2 to dp=4 (half the accumulation), and every
    step's loss and grad norm is the one-process run's."""
    run = tmp_path / "run"
    args = test_overrides(data_cache, str(run), GROW_STEPS) + [
        "--train.log_every=1", "--train.micro_batch=2", "--checkpoint.every=2",
        "--checkpoint.resume=true"]
    # last_call_timeout: how long a round waits for more nodes once it has the minimum (1).
    # The default 30 s would hold each of A's starts that long; the agents poll the rendezvous
    # every second, so 3 s lets A's and B's meet in the grown round.
    conf = ",last_call_timeout=3"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    # The kill goes to A alone: B's count stays 0, so its ranks would all be "first attempts".
    killed = {**GROW_ENV, "MESHTRON_FAULTS": GROW_ENV["MESHTRON_FAULTS"] + ";kill:rank=1:step=3"}
    elastic = ("--max-restarts=1",)
    procs = [_node(0, two_nodes, args, logs[0], "1:2", conf, elastic, False, killed)]
    try:
        procs.append(_node(1, two_nodes, args, logs[1], "1:2", conf, elastic, True, GROW_ENV))
        _wait_for(STEP_3, logs[0], procs[0], 240)  # logged only after the restart
        procs[1].stdin.write("go\n")
        procs[1].stdin.close()
        for proc in procs:
            proc.wait(timeout=240)
    finally:
        _stop(procs, run)
    text = logs[0].read_text() + logs[1].read_text()
    assert [proc.returncode for proc in procs] == [0, 0], text[-4000:]
    assert "mesh: 2 ranks, tp=1 cp=1 dp=2 pp=1; micro-batch 2 x 2 accumulation steps" in text
    assert "mesh: 4 ranks, tp=1 cp=1 dp=4 pp=1; micro-batch 2 x 1 accumulation steps" in text
    grown = re.search(r"resumed from \S+ at step (\d+); saved under tp=1 cp=1 dp=2 pp=1, "
                      r"resharded to tp=1 cp=1 dp=4 pp=1", text)
    assert grown and 2 <= int(grown.group(1)) < GROW_STEPS, text[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {row["step"]: row for row in rows if "event" not in row}
    assert sorted(steps) == list(range(1, GROW_STEPS + 1))
    one = run_training(test_overrides(data_cache, str(tmp_path / "one"), GROW_STEPS))
    for step, row in steps.items():
        for key, expected in (("loss", one["loss"][step - 1]),
                              ("grad_norm", one["grad_norm"][step - 1])):
            assert abs(row[key] - expected) <= 1e-4 * abs(expected), (step, key)
