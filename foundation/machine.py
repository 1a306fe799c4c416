"""What machine a figure was measured on: the CPU model, for benchmarks and device identities."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (``model name``), e.g. ``Intel(R) Xeon(R)
    Processor``; elsewhere ``platform.processor()`` or ``platform.machine()``, else ``unknown``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
