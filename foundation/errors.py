"""The one error root of ragbudget, and its small tree.

Every error the project raises on purpose derives from :class:`RagBudgetError`
and carries a stable, machine-readable ``code``. HTTP status codes and CLI exit
codes are mapped only at the edges (``app.api.errors`` and ``app.cli.common``),
never here. Every public code, with its status and meaning, is listed once in
:mod:`foundation.error_codes` (``docs/errors.md``)::

    RagBudgetError                      code
    ├── InvalidInput                    invalid_input        (bad request data)
    │   ├── UnsupportedParameter        unsupported_parameter (a request field ragbudget refuses)
    │   ├── EmptyContent                empty_content
    │   ├── InvalidEncoding             invalid_encoding
    │   ├── UnsupportedType             unsupported_type
    │   ├── TooLarge                    too_large
    │   ├── InvalidDocumentId           invalid_document_id
    │   └── ContextLengthExceeded       context_length_exceeded (prompt + max tokens over the window)
    ├── InvalidConfig                   invalid_config       (the server's settings; not the caller's fault)
    ├── NotFound                        not_found
    │   ├── UnknownModel                model_not_found
    │   ├── UnknownDocument             unknown_document
    │   ├── UnknownVersion              unknown_version
    │   ├── UnknownRevision             unknown_revision
    │   ├── UnknownReceipt              unknown_receipt
    │   └── UnknownProfile              unknown_profile
    ├── Conflict                        conflict             (concurrent writers, retry)
    ├── Busy                            busy                 (queue full; retry later)
    ├── BudgetUnreachable               budget_unreachable   (not even k = 0 can make the TTFT budget)
    ├── AuthError
    │   ├── Unauthenticated             unauthenticated
    │   └── Forbidden                   forbidden
    ├── IntegrityFailure                integrity_failure    (a hash or index does not verify)
    ├── BackendError                    backend_error        (model or remote engine failed)
    └── Unavailable                     database_unavailable (the database cannot be reached)
"""

from __future__ import annotations

from typing import Any


class RagBudgetError(Exception):
    """Root of every deliberate ragbudget error.

    Attributes:
        code: stable machine-readable identifier (snake_case), part of the API.
        message: human-readable explanation.
        details: optional JSON-serialisable context (e.g. the offending field).
    """

    code = "ragbudget_error"

    def __init__(self, message: str, *, code: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """Return ``{"code", "message", "details"}`` for APIs and ``--json`` output."""
        return {"code": self.code, "message": self.message, "details": self.details}


class InvalidInput(RagBudgetError):
    """Bad request data: the caller can fix it; nothing was written."""

    code = "invalid_input"


class UnsupportedParameter(InvalidInput):
    """A request field (or value) that ragbudget does not honour, refused rather than ignored.

    ``details["param"]`` names the field, as a path (``"n"``, ``"messages[2].content[0].type"``).
    """

    code = "unsupported_parameter"


class EmptyContent(InvalidInput):
    """A document with no visible text after extraction and normalisation."""

    code = "empty_content"


class InvalidEncoding(InvalidInput):
    """Bytes that are not valid UTF-8 or contain NUL (binary); ``offset`` is the first bad byte."""

    code = "invalid_encoding"


class UnsupportedType(InvalidInput):
    """A file suffix or document kind the extractor does not handle."""

    code = "unsupported_type"


class TooLarge(InvalidInput):
    """A body, document or batch over its configured limit; the limit is in the details."""

    code = "too_large"


class InvalidDocumentId(InvalidInput):
    """A document id that breaks the id grammar; ``rule`` in the details names the broken rule."""

    code = "invalid_document_id"


class InvalidConfig(RagBudgetError):
    """Settings, options or model files that cannot work (e.g. a chunk overlap not below the window).

    A server-side error, not bad request data: found while serving a request it answers
    HTTP 500 (the operator must fix the settings; the caller cannot), while the CLI, whose
    user is the operator, exits 2 as for bad input.
    """

    code = "invalid_config"


class ContextLengthExceeded(InvalidInput):
    """The prompt, or the prompt with the output tokens asked for, does not fit the model's
    context window; refused before the request queues and before any token.

    ``details``: ``field`` (``question``: the prompt alone fills the window; ``max_new_tokens``:
    the output tokens asked for do not fit beside it), ``prompt_tokens``, ``max_new_tokens``,
    ``context_window``.
    """

    code = "context_length_exceeded"


class NotFound(RagBudgetError):
    """The named object does not exist."""

    code = "not_found"


class UnknownModel(NotFound):
    """A model id this server does not serve (``GET /v1/models`` lists those it does)."""

    code = "model_not_found"


class UnknownDocument(NotFound):
    """No such document id, or no live version of it where one is needed."""

    code = "unknown_document"


class UnknownVersion(NotFound):
    """The document exists but has no such version number."""

    code = "unknown_version"


class UnknownRevision(NotFound):
    """No corpus revision with that number."""

    code = "unknown_revision"


class UnknownReceipt(NotFound):
    """No receipt with that id."""

    code = "unknown_receipt"


class UnknownProfile(NotFound):
    """No latency profile with that id or prefix."""

    code = "unknown_profile"


class Conflict(RagBudgetError):
    """A concurrent writer got there first; retrying the request is safe."""

    code = "conflict"


class Busy(RagBudgetError):
    """A bounded queue is full; ``retry_after_s`` says when to come back."""

    code = "busy"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, **details: Any) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.retry_after_s = retry_after_s


class BudgetUnreachable(RagBudgetError):
    """Even ``k = 0`` cannot make the request's TTFT budget and it asked to be refused.

    ``predicted_ttft_ms``: the TTFT ``k = 0`` would have (time spent + predicted wait +
    predicted prefill p50); ``retry_after_s``: when the model is predicted to be free;
    ``retryable``: False when no retry can help (k = 0 alone, on an idle model, is predicted over
    the budget), so the edge invites none.
    """

    code = "budget_unreachable"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, predicted_ttft_ms: float,
                 retryable: bool = True, **details: Any) -> None:
        super().__init__(message, retry_after_s=retry_after_s, predicted_ttft_ms=predicted_ttft_ms,
                         retryable=retryable, **details)
        self.retry_after_s = retry_after_s
        self.predicted_ttft_ms = predicted_ttft_ms
        self.retryable = retryable


class AuthError(RagBudgetError):
    """Root of authentication and authorisation failures."""

    code = "auth_error"


class Unauthenticated(AuthError):
    """No valid API key was presented."""

    code = "unauthenticated"


class Forbidden(AuthError):
    """The API key's role does not allow this route."""

    code = "forbidden"


class IntegrityFailure(RagBudgetError):
    """Stored data does not verify: a hash, a chain link or an index checksum differs."""

    code = "integrity_failure"


class BackendError(RagBudgetError):
    """The model or a remote engine failed while serving a request."""

    code = "backend_error"


class Unavailable(RagBudgetError):
    """The database (or another store) cannot be reached or refused the connection; retry later."""

    code = "database_unavailable"
