"""What machine a benchmark ran on, for its report (imported as ``from host import host_info``,
like :mod:`spawn`)."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any

import torch


def host_info(**extra: Any) -> dict[str, Any]:
    """CPU model, cores, torch and Python versions, date and load average, plus ``extra``."""
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in
              (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
              if line.startswith("model name")]
    return {
        "cpu": models[0] if models else platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average": os.getloadavg(), **extra,
    }
