"""Request limits shared by the API and the CLI: each violation is an InvalidInput with a code."""

from __future__ import annotations

import math

from app.settings import Settings
from foundation.errors import InvalidInput, TooLarge
from foundation.hashing import normalize_text
from retrieval.retriever import is_blank_query


def check_question(settings: Settings, question: str) -> str:
    """Return the question normalised as stored text is (``foundation.hashing.normalize_text``:
    zero-width characters and soft hyphens removed, no-break spaces to spaces, NFC) and
    stripped of surrounding whitespace.

    Raises:
        InvalidInput (code ``empty_question``): empty, whitespace-only or invisible-only.
        TooLarge (code ``question_too_long``): longer than ``max_question_chars`` (as sent).
    """
    if question is None or not normalize_text(question).strip():
        raise InvalidInput("question is empty", code="empty_question")
    if len(question) > settings.max_question_chars:
        raise TooLarge(f"question has {len(question)} characters; the limit is "
                       f"{settings.max_question_chars}", code="question_too_long",
                       limit=settings.max_question_chars)
    return normalize_text(question).strip()


def check_budget(settings: Settings, budget_ms: float | None) -> float:
    """Return the TTFT budget in ms (the configured default when None).

    Raises:
        InvalidInput (code ``invalid_budget``): not a finite number in
            ``[min_budget_ms, max_budget_ms]``.
    """
    if budget_ms is None:
        return float(settings.default_ttft_budget_ms)
    b = float(budget_ms)
    if not math.isfinite(b) or b < settings.min_budget_ms or b > settings.max_budget_ms:
        raise InvalidInput(f"ttft_budget_ms must be a number in [{settings.min_budget_ms}, "
                           f"{settings.max_budget_ms}] ms, got {budget_ms}", code="invalid_budget",
                           min=settings.min_budget_ms, max=settings.max_budget_ms, field="ttft_budget_ms")
    return b


def check_k(settings: Settings, k: int | None, default: int) -> int:
    """Return k (``default`` when None). Raises InvalidInput (``invalid_k``) outside 1..max_k.

    ``k_max`` caps the retrieval candidates an answer may use; retrieval needs at least one
    (``retrieval.retriever`` refuses k = 0), so the API schemas say ``ge=1`` as well. The
    planner itself may still choose k = 0 (no chunk fits the budget).
    """
    if k is None:
        return min(default, settings.max_k)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= settings.max_k:
        raise InvalidInput(f"k_max must be an integer in [1, {settings.max_k}], got {k!r}", code="invalid_k",
                           limit=settings.max_k, field="k_max")
    return k


def check_max_new_tokens(settings: Settings, n: int | None) -> int:
    """Return max_new_tokens (default when None). Raises InvalidInput (``invalid_max_new_tokens``)."""
    if n is None:
        return settings.default_max_new_tokens
    if not 1 <= int(n) <= settings.max_new_tokens_limit:
        raise InvalidInput(f"max_new_tokens must be in [1, {settings.max_new_tokens_limit}], got {n}",
                           code="invalid_max_new_tokens", limit=settings.max_new_tokens_limit,
                           field="max_new_tokens")
    return int(n)


def check_query(settings: Settings, query: str, k: int) -> None:
    """Validate before any model is loaded.

    Raises:
        InvalidInput: ``empty_query`` (blank), ``invalid_k`` (outside 1..max_k).
        TooLarge: ``query_too_long`` (more than ``max_question_chars`` characters).
    """
    if is_blank_query(query):
        raise InvalidInput("the query is empty or whitespace only", code="empty_query")
    if len(query) > settings.max_question_chars:
        raise TooLarge(f"query has {len(query)} characters; the limit is {settings.max_question_chars}",
                       code="query_too_long", limit=settings.max_question_chars)
    if not 1 <= k <= settings.max_k:
        raise InvalidInput(f"k must be in [1, {settings.max_k}], got {k}", code="invalid_k",
                           limit=settings.max_k)


def check_on_budget_miss(value: str | None) -> str | None:
    """Return ``value`` (``answer``, ``reject`` or None for the configured default).

    Raises:
        InvalidInput: (``invalid_on_budget_miss``) any other value.
    """
    if value is not None and value not in ("answer", "reject"):
        raise InvalidInput(f"on_budget_miss must be 'answer' or 'reject', got {value!r}",
                           code="invalid_on_budget_miss", field="on_budget_miss")
    return value
