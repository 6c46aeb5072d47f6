"""What machine a benchmark ran on, for its report and its first printed line."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, else what :mod:`platform` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in
              (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
              if line.startswith("model name")]
    return models[0] if models else platform.processor() or platform.machine()


def host_info(**extra: Any) -> dict[str, Any]:
    """CPU model, cores, torch and Python versions, date and load average, plus ``extra``."""
    import torch  # here: importing the harness does not load torch

    return {
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average": os.getloadavg(), **extra,
    }


def package_version(name: str) -> str | None:
    """The installed version of distribution ``name`` (an optional peer), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_line(info: dict[str, Any], *details: str) -> str:
    """One line for the top of the output: date, CPU, cores, torch and Python, ``details``,
    load average."""
    load = " ".join(f"{x:.1f}" for x in info["load_average"])
    return "; ".join([f"{info['date']}  {info['cpu']}, {info['cores']} cores, torch "
                      f"{info['torch']}, Python {info['python']}", *details,
                      f"load average {load}"])
