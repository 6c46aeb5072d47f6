"""The benchmarks' shared harness: everything a benchmark does besides what it measures.

- :mod:`.processes`: :func:`spawn` runs a task on ``world`` ranks of a fresh gloo group (one
  torch thread each, ``file://`` rendezvous) and returns the results in rank order.
- :mod:`.timing`: :func:`timed` (one call, after an untimed barrier), :func:`interleave`
  (competitors in rounds, the order rotating every round, so drifting load from other jobs hits
  all alike), :func:`rotated` (that order, for loops that need more than timing), the two ratios
  the reports print (:func:`ratio_of_medians`; :func:`pair_ratio`, the median of per-round
  ratios), :func:`across_ranks` (the slowest rank's time per step) and :func:`check_close`.
- :mod:`.memory`: RSS and its high-water mark from ``/proc``, :data:`EXACT_ALLOCATOR`, and
  :func:`saved_activation_bytes` (what autograd keeps for backward in one step).
- :mod:`.host`: :func:`host_info` (the machine, for the JSON), :func:`host_line` (the first
  printed line), :func:`cpu_model` and :func:`package_version` (an optional peer's version).
- :mod:`.report`: :func:`markdown_table` (as the tables of docs/performance.md), profiler
  summaries, and the JSON report (:func:`record`, :func:`write_json`).
- :mod:`.cli`: ``cli.parser(__doc__, cli.steps(10), ...)``, with ``--json OUT`` and the common
  flags.

A benchmark is run as ``python benchmarks/X.py``: the script's directory is first on
``sys.path`` (with or without ``PYTHONPATH=.``), so it imports this package as ``harness``, and
the processes it spawns inherit that path. Nothing here imports torch or meshtron at import
time; the harness needs meshtron only for ``exit_process`` in the spawned workers.
"""

from harness import cli
from harness.host import cpu_model, host_info, host_line, package_version
from harness.memory import EXACT_ALLOCATOR, reset_peak_rss, saved_activation_bytes, vm_status
from harness.processes import spawn
from harness.report import (
    markdown_table,
    plain_args,
    print_top_ops,
    record,
    top_ops,
    write_json,
)
from harness.timing import (
    Timed,
    across_ranks,
    check_close,
    interleave,
    pair_ratio,
    ratio_of_medians,
    rotated,
    timed,
)

__all__ = [
    "EXACT_ALLOCATOR", "Timed", "across_ranks", "check_close", "cli", "cpu_model", "host_info",
    "host_line", "interleave", "markdown_table", "package_version", "pair_ratio", "plain_args",
    "print_top_ops", "ratio_of_medians", "record", "reset_peak_rss", "rotated",
    "saved_activation_bytes", "spawn", "timed", "top_ops", "vm_status", "write_json",
]
