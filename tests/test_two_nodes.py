"""Two "nodes" on one machine: network namespaces joined by a veth pair, a 2 x 2-rank job over
torchrun's c10d rendezvous, then one node's link is cut. The other node must notice within
``run.timeout_s`` and exit with a line naming the ranks it lost (the hang watchdog), not hang.
Skipped, saying why, where namespaces cannot be made (not root, no ``ip``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.parity import test_overrides
from tests.test_cli import _JOB_VARIABLES

TIMEOUT_S = 10
STEP_5 = re.compile(r"^step +5/", re.MULTILINE)


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


def _node(node: int, nodes, args: list[str], out: Path) -> subprocess.Popen:
    namespace, interface, address = nodes[node]
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARIABLES and not k.startswith(("SLURM_", "MESHTRON_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=interface)
    command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{nodes[0][2]}:29555", "--rdzv-id", "two-nodes",
               "--rdzv-conf", f"is_host={str(node == 0).lower()}", "--local-addr", address,
               "-m", "meshtron", "train", *args]
    return subprocess.Popen(command, stdout=open(out, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            env=env, start_new_session=True, text=True)


@pytest.mark.slow
def test_a_cut_link_is_detected_by_the_other_node_within_the_timeout(data_cache, tmp_path,
                                                                     two_nodes):
    args = test_overrides(data_cache, str(tmp_path / "run"), 100_000) + [
        "--train.log_every=1", f"--run.timeout_s={TIMEOUT_S}", "--checkpoint.every=0"]
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    procs = [_node(0, two_nodes, args, logs[0]), _node(1, two_nodes, args, logs[1])]
    try:
        deadline = time.monotonic() + 180
        while not STEP_5.search(logs[0].read_text()) and time.monotonic() < deadline:
            assert procs[0].poll() is None, logs[0].read_text()[-2000:]
            time.sleep(0.2)
        assert STEP_5.search(logs[0].read_text()), "the job never got going"
        _ip("-n", two_nodes[1][0], "link", "set", two_nodes[1][1], "down")
        cut = time.monotonic()
        procs[0].wait(timeout=TIMEOUT_S + 90)
        detected = time.monotonic() - cut
    finally:  # the agents start their ranks in sessions of their own: find them by run.dir
        for proc in procs:
            subprocess.run(["pkill", "-9", "-s", str(proc.pid)], capture_output=True)
        subprocess.run(["pkill", "-9", "-f", str(tmp_path / "run")], capture_output=True)
        for proc in procs:
            proc.wait()
    text = logs[0].read_text()
    lines = [line for line in text.splitlines() if line.startswith("meshtron: error: rank ")]
    assert lines, text[-3000:]
    assert any(("unresponsive: rank 2" in line or "unresponsive: rank 3" in line)
               and f"(run.timeout_s={TIMEOUT_S})" in line for line in lines), lines
    assert procs[0].returncode != 0 and detected < TIMEOUT_S + 60, detected
