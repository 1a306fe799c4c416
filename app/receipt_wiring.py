"""Wiring replay into the app: the retriever and the prompt/regeneration hooks (CLI and API).

``receipts`` never imports ``app``; what replay needs from here (rebuilding a
prompt, regenerating) comes from :func:`app.pipeline.replay_hooks`, imported
lazily. While that hook or the retriever is not available, replay still runs
the checks it can and marks the others ``skipped``.
"""

from __future__ import annotations

import logging
from typing import Any

from app.services import Services
from receipts.replay import ReplayReport, replay

log = logging.getLogger("ragbudget")


def _retriever(services: Services) -> Any:
    try:
        return services.retriever
    except ModuleNotFoundError as exc:  # the retriever is not part of this build yet
        log.warning("replay without retrieval: %s", exc)
        return None


def _hooks(services: Services) -> tuple[Any, Any]:
    try:
        from app.pipeline import replay_hooks  # type: ignore[attr-defined]
    except ImportError:
        return None, None
    return replay_hooks(services)  # type: ignore[no-any-return]


def _environment() -> dict[str, Any]:
    try:
        from app.pipeline import software_versions
    except ImportError:
        return {}
    return {f"software.{k}": v for k, v in software_versions().items()}


def replay_receipt(services: Services, receipt_id: str, *, regenerate: bool = False) -> ReplayReport:
    """Replay ``receipt_id`` with this process's retriever and hooks (see :func:`receipts.replay.replay`).

    Raises:
        UnknownReceipt: no receipt has that id.
    """
    rebuild_prompt, regenerate_hook = _hooks(services)
    return replay(
        services.engine, receipt_id, retriever=_retriever(services), rebuild_prompt=rebuild_prompt,
        regenerate=regenerate_hook if regenerate else None,
        current_environment=_environment() if regenerate else None, want_regenerate=regenerate,
    )
