"""Fleet fixtures: separate network hosts (namespaces) on this machine.

Tests that need separate hosts make network namespaces themselves
(:mod:`ragbudget_testing.netns`). Without root or ``ip`` they are skipped with the reason,
unless ``RAGBUDGET_REQUIRE_NETNS=1`` (``scripts/test.sh`` sets it when it runs as root with
``ip`` installed), which makes that an error.
"""

from __future__ import annotations

import os
import shutil

import pytest


def require_netns(*tools: str) -> None:
    """Skip (or, with ``RAGBUDGET_REQUIRE_NETNS=1``, fail) when namespaces cannot be made here,
    or one of ``tools`` (commands the test runs besides ``ip``) is not installed."""
    from ragbudget_testing.netns import unavailable_reason

    reason = unavailable_reason()
    missing = [t for t in tools if shutil.which(t) is None]
    if reason is None and missing:
        reason = f"{', '.join(missing)} not installed (util-linux)"
    if reason is None:
        return
    if os.environ.get("RAGBUDGET_REQUIRE_NETNS") == "1":
        pytest.fail(f"RAGBUDGET_REQUIRE_NETNS=1 but {reason}")
    pytest.skip(reason)
