"""Fleet fixtures: separate network hosts (namespaces) on this machine.

Tests that need separate hosts make network namespaces themselves
(:mod:`ragbudget_testing.netns`). Without root or ``ip`` they are skipped with the reason,
unless ``RAGBUDGET_REQUIRE_NETNS=1`` (``scripts/test.sh`` sets it when it runs as root with
``ip`` installed), which makes that an error.
"""

from __future__ import annotations

import os

import pytest


def require_netns() -> None:
    """Skip (or, with ``RAGBUDGET_REQUIRE_NETNS=1``, fail) when namespaces cannot be made here."""
    from ragbudget_testing.netns import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("RAGBUDGET_REQUIRE_NETNS") == "1":
        pytest.fail(f"RAGBUDGET_REQUIRE_NETNS=1 but {reason}")
    pytest.skip(reason)
