"""What the benchmark scripts share: quantiles, the machine a figure was measured on, timing, JSONL.

Every script is run from the repository root as ``python -m benchmarks.NAME`` (the
root is then on the import path; no script edits the import path itself).

* :func:`quantile`: the one percentile of the benchmarks, numpy's ``np.quantile``
  with its default linear interpolation (type 7 of Hyndman and Fan, 1996).
* :func:`cpu_model`, :func:`machine`, :func:`machine_line`: CPU model, cores and load average.
* :func:`elapsed_ms`: ``time.perf_counter()`` differences in milliseconds, converted once.
* :func:`append_jsonl`: one JSON object per line, appended (resumable runs).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: The repository root (the folder holding ``benchmarks/``).
REPO = Path(__file__).resolve().parents[1]

#: Where the run files the docs cite live (docs/benchmarks.md).
RESULTS = REPO / "benchmarks" / "results"


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (``0 <= q <= 1``) of ``values`` by linear interpolation (``np.quantile``).

    Raises:
        ValueError: ``values`` is empty or ``q`` is outside ``[0, 1]``.
    """
    if len(values) == 0:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    return float(np.quantile(np.asarray(values, dtype=float), q))


def quantile_or_none(values: Sequence[float], q: float) -> float | None:
    """:func:`quantile`, or None when ``values`` is empty (a cell where nothing was answered)."""
    return quantile(values, q) if len(values) else None


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


def machine() -> dict[str, Any]:
    """``{"cpu": model name, "cores": os.cpu_count(), "loadavg": [1, 5, 15 min]}`` now."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "loadavg": list(os.getloadavg())}


def machine_line() -> str:
    """:func:`machine` as one printable line: ``"<cpu>, <n> cores, load average <1 min>"``."""
    m = machine()
    return f"{m['cpu']}, {m['cores']} cores, load average {m['loadavg'][0]:.2f}"


def elapsed_ms(t0: float) -> float:
    """Milliseconds since ``t0``, a ``time.perf_counter()`` reading."""
    return (time.perf_counter() - t0) * 1000.0


def append_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Append each row to ``path`` as one JSON line (the file and its folder are created if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
