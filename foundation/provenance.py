"""Where a record came from: the UTC clock format and the software versions that decide outputs.

One definition each, used by receipts, latency profiles, the store and the API
keys, so that every record states time and provenance the same way.
"""

from __future__ import annotations

import platform
from datetime import UTC, datetime
from functools import lru_cache
from importlib import metadata

# Distribution name on the package index -> key recorded in receipts and profiles.
# These are the libraries whose versions can change an output bit (embeddings,
# retrieval order, generated tokens, timings).
_PACKAGES = {
    "ragbudget": "ragbudget",
    "torch": "torch",
    "transformers": "transformers",
    "sentence-transformers": "sentence_transformers",
    "onnxruntime": "onnxruntime",
    "openvino": "openvino",
    "faiss-cpu": "faiss",
    "numpy": "numpy",
    "scipy": "scipy",
}


def utc_now_iso() -> str:
    """Now as ISO-8601 UTC with microseconds, e.g. ``2025-01-02T03:04:05.000006+00:00``."""
    return datetime.now(UTC).isoformat(timespec="microseconds")


def to_utc_iso(value: datetime) -> str:
    """``value`` in the stored time format (UTC, microseconds); a naive time is taken as UTC.

    Raises:
        OverflowError: the time is out of range once converted to UTC (e.g. year 1 at +01:00).
    """
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat(timespec="microseconds")


@lru_cache(maxsize=1)
def software_versions() -> dict[str, str]:
    """Versions of Python and of the packages that decide outputs (``"absent"`` when not installed).

    Read from package metadata (nothing heavy is imported), cached per process.
    Keys: ``python, ragbudget, torch, transformers, sentence_transformers, onnxruntime, openvino,
    faiss, numpy, scipy``.
    """
    out = {"python": platform.python_version()}
    for dist, key in _PACKAGES.items():
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = "absent"
    return dict(out)
