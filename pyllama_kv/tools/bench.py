"""Helpers shared by the benchmark scripts in ``scripts/``: the machine a result was measured on."""
from __future__ import annotations

import os
import platform
from pathlib import Path

__all__ = ["machine"]


def machine() -> dict:
    """CPU model, core count, platform and Python version, for the ``machine`` field of a result."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}

