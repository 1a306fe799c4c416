"""HTTP mapping of ragbudget errors: status codes live here and nowhere else.

Every error body is ``{"error": {"code", "message", "details"}}``. The routes
that speak OpenAI's wire format (:data:`OPENAI_PATHS`: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``) answer in OpenAI's error shape as well, so OpenAI clients read
them: the same object also carries ``type`` (``invalid_request_error``, ...)
and ``param`` (the offending field, e.g. ``"n"`` or ``"messages[1].role"``, or
null), and a request error is 400 there, as OpenAI answers it, where the other
routes answer 422.

Retries: a 429 ``busy`` and a 503 ``budget_unreachable`` that waiting can help carry
``Retry-After`` (the server's predicted wait, rounded up to whole seconds, at least 1) and
``x-should-retry: true``; a ``budget_unreachable`` no retry can help (k = 0 alone is over the
budget with the model idle) carries ``x-should-retry: false`` and no ``Retry-After``
(``x-should-retry`` is the header the openai client obeys before its own rules; docs/clients.md).
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from foundation.db_errors import translate_db_error
from foundation.error_codes import ErrorCode
from foundation.errors import (
    BudgetUnreachable,
    Busy,
    Conflict,
    Forbidden,
    IntegrityFailure,
    InvalidConfig,
    InvalidInput,
    NotFound,
    RagBudgetError,
    TooLarge,
    Unauthenticated,
    Unavailable,
    UnsupportedParameter,
)

# Every public code with the status it answers: foundation.error_codes (docs/errors.md); its
# statuses are checked against this list. InvalidConfig is the server's own misconfiguration
# (a 500 the operator fixes), never the caller's 422.
STATUS: list[tuple[type[RagBudgetError], int]] = [
    (InvalidConfig, 500),
    (UnsupportedParameter, 400),
    (TooLarge, 413),
    (InvalidInput, 422),
    (NotFound, 404),
    (Conflict, 409),
    (Busy, 429),
    (BudgetUnreachable, 503),
    (Unauthenticated, 401),
    (Forbidden, 403),
    (IntegrityFailure, 409),
    (Unavailable, 503),
    (RagBudgetError, 500),
]


def status_for(exc: RagBudgetError) -> int:
    """The HTTP status for a ragbudget error (first matching class in :data:`STATUS`)."""
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def error_body(code: str, message: str, details: object | None = None) -> dict[str, object]:
    """The JSON error envelope: ``{"error": {"code", "message", "details"}}``."""
    return {"error": {"code": code, "message": message, "details": details or {}}}


#: Path prefixes of the OpenAI-compatible routes (OpenAI's error shape, 400 for request errors).
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")
_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def is_openai_path(path: str) -> bool:
    """True for the routes that speak OpenAI's wire format (see the module docstring)."""
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


def openai_error(status: int, code: str, message: str, details: dict[str, Any] | None = None,
                 param: str | None = None) -> tuple[int, dict[str, object]]:
    """``(status, body)`` in OpenAI's error shape plus ragbudget's ``details``.

    ``{"error": {"message", "type", "param", "code", "details"}}``; ``type`` is
    ``invalid_request_error`` for 4xx (``authentication_error`` 401, ``permission_error``
    403, ``rate_limit_error`` 429) and ``server_error`` for 5xx; 422 becomes 400.
    """
    details = dict(details or {})
    if param is None:
        found = details.get("param", details.get("field"))
        param = str(found) if found is not None else None
    status = 400 if status == 422 else status
    kind = "server_error" if status >= 500 else _OPENAI_TYPES.get(status, "invalid_request_error")
    return status, {"error": {"message": message, "type": kind, "param": param, "code": code,
                              "details": details}}


def loc_param(loc: list[Any]) -> str | None:
    """A validation error's location as a field path: ``["body", "messages", 0, "role"]`` ->
    ``"messages[0].role"``; None for the body as a whole."""
    parts = [p for p in loc if p not in ("body", "query", "header", "path")]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


class ErrorDetail(BaseModel):
    """The ``error`` object of every 4xx/5xx body.

    ``code``: stable machine-readable code (what clients branch on); ``message``: one line
    for people (may change between versions); ``details``: code-specific context, e.g. the
    offending ``field`` or the allowed range (may be empty); ``type`` and ``param``: set on
    the OpenAI-compatible routes only, as OpenAI's error shape has them.
    """

    code: str = Field(..., description="Stable machine-readable code, e.g. unauthenticated, invalid_k")
    message: str
    details: dict[str, Any]
    type: str | None = Field(None, description="OpenAI-compatible routes only: invalid_request_error, "
                                               "authentication_error, permission_error, rate_limit_error "
                                               "or server_error")
    param: str | None = Field(None, description="OpenAI-compatible routes only: the offending field, "
                                                "e.g. n or messages[1].role (null when none)")


class ErrorEnvelope(BaseModel):
    """Every 4xx/5xx body: ``{"error": {"code", "message", "details"}}``."""

    error: ErrorDetail


# Documented on every route (``include_router(..., responses=ERROR_RESPONSES)``), so the OpenAPI
# schema describes the error bodies: 401/403 auth, 404, 409, 413 limits, 422 validation, 429 busy.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorEnvelope, "description": "Error with a machine-readable code"},
}

# Codes for errors raised by Starlette/FastAPI themselves (unparseable body, unknown path, ...).
_HTTP_CODES = {400: ErrorCode.MALFORMED_BODY, 404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED,
               413: ErrorCode.BODY_TOO_LARGE, 415: ErrorCode.UNSUPPORTED_MEDIA_TYPE}


#: Request fields that are sampling parameters: their schema violations answer
#: ``invalid_sampling_parameter`` (as :meth:`generation.base.GenParams.validate` does), not
#: the generic ``invalid_request``.
SAMPLING_FIELDS = frozenset({"temperature", "top_p", "seed", "min_tokens", "ignore_eos"})


def _json_scalar(value: Any) -> bool:
    """True for a value JSON can carry as it is (no NaN or infinity, no containers)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, bool | int | str)


def install_error_handlers(app: FastAPI) -> None:
    """Map ``RagBudgetError``, request validation errors, Starlette's own HTTP errors
    (unparseable body, unknown path), database and driver errors (through
    :func:`foundation.db_errors.translate_db_error`: 422 ``invalid_value``, 409, 503) and,
    last, any other exception (500 ``internal_error``) to the JSON error envelope: no
    route answers a plain-text 500."""

    def respond(req: Request, status: int, code: str, message: str, details: dict[str, Any],
                headers: dict[str, str] | None = None, param: str | None = None) -> JSONResponse:
        if is_openai_path(req.url.path):
            status, body = openai_error(status, code, message, details, param)
            return JSONResponse(body, status_code=status, headers=headers)
        return JSONResponse(error_body(code, message, details), status_code=status, headers=headers)

    @app.exception_handler(RagBudgetError)
    async def _ragbudget_error(req: Request, exc: RagBudgetError) -> JSONResponse:
        headers = {}
        if isinstance(exc, BudgetUnreachable) and not exc.retryable:
            headers["x-should-retry"] = "false"  # no wait helps: no Retry-After, no retry invited
        elif isinstance(exc, Busy | BudgetUnreachable):
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
            headers["x-should-retry"] = "true"
        elif exc.code == "engine_unavailable" and isinstance(exc.details.get("retry_after_s"), int | float):
            # every engine out of rotation: come back at the next probe, not at once
            headers["Retry-After"] = str(max(1, math.ceil(exc.details["retry_after_s"])))
            headers["x-should-retry"] = "true"
        if isinstance(exc, Unauthenticated):
            headers["WWW-Authenticate"] = "Bearer"
        return respond(req, status_for(exc), exc.code, exc.message, exc.details, headers)

    @app.exception_handler(SQLAlchemyError)
    async def _db_error(req: Request, exc: SQLAlchemyError) -> JSONResponse:
        return await _ragbudget_error(req, translate_db_error(exc))

    @app.exception_handler(Exception)
    async def _unexpected(req: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback (server side) and still sends this body.
        return respond(req, 500, ErrorCode.INTERNAL_ERROR, "internal error; the server log has the details",
                       {"error_type": type(exc).__name__})

    @app.exception_handler(RequestValidationError)
    async def _validation_error(req: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")),
                   "type": str(e.get("type", ""))} for e in exc.errors()]
        if any(e["type"] == "json_invalid" for e in errors):
            # The body is not JSON at all: a syntax error, not a schema violation.
            return respond(req, 400, ErrorCode.MALFORMED_BODY, "request body is not valid JSON",
                           {"errors": errors})
        first = errors[0] if errors else {"loc": [], "msg": ""}
        param = loc_param(list(first["loc"]))
        if param in SAMPLING_FIELDS:
            # The schema's range or type check of a sampling field: the code GenParams.validate
            # gives for the same fault (generation.base), so clients branch on one code.
            value = next((e.get("input") for e in exc.errors()), None)
            return respond(req, 422, ErrorCode.INVALID_SAMPLING_PARAMETER,
                           f"{param}: {first['msg']}, got {value!r}",
                           {"param": param, "value": value if _json_scalar(value) else repr(value),
                            "errors": errors}, param=param)
        message = ("request failed validation" if param is None
                   else f"request failed validation: {param}: {first['msg']}")
        return respond(req, 422, ErrorCode.INVALID_REQUEST, message, {"errors": errors}, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, ErrorCode.HTTP_ERROR)
        return respond(req, exc.status_code, code, str(exc.detail), {},
                       headers=getattr(exc, "headers", None))
