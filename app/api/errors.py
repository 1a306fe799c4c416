"""HTTP mapping of ragbudget errors: status codes live here and nowhere else."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from foundation.errors import (
    Busy,
    Conflict,
    Forbidden,
    IntegrityFailure,
    InvalidInput,
    NotFound,
    RagBudgetError,
    TooLarge,
    Unauthenticated,
)

STATUS: list[tuple[type[RagBudgetError], int]] = [
    (TooLarge, 413),
    (InvalidInput, 422),
    (NotFound, 404),
    (Conflict, 409),
    (Busy, 429),
    (Unauthenticated, 401),
    (Forbidden, 403),
    (IntegrityFailure, 409),
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


class ErrorDetail(BaseModel):
    code: str = Field(..., description="Stable machine-readable code, e.g. unauthenticated, invalid_k")
    message: str
    details: dict[str, Any]


class ErrorEnvelope(BaseModel):
    """Every 4xx/5xx body: ``{"error": {"code", "message", "details"}}``."""

    error: ErrorDetail


# Documented on every route (``include_router(..., responses=ERROR_RESPONSES)``), so the OpenAPI
# schema describes the error bodies: 401/403 auth, 404, 409, 413 limits, 422 validation, 429 busy.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorEnvelope, "description": "Error with a machine-readable code"},
}

# Codes for errors raised by Starlette/FastAPI themselves (unparseable body, unknown path, ...).
_HTTP_CODES = {400: "malformed_body", 404: "not_found", 405: "method_not_allowed",
               413: "body_too_large", 415: "unsupported_media_type"}


def install_error_handlers(app: FastAPI) -> None:
    """Map ``RagBudgetError``, request validation errors and Starlette's own HTTP errors
    (unparseable body, unknown path) to the JSON error envelope."""

    @app.exception_handler(RagBudgetError)
    async def _ragbudget_error(_req: Request, exc: RagBudgetError) -> JSONResponse:
        headers = {}
        if isinstance(exc, Busy):
            headers["Retry-After"] = str(max(1, int(round(exc.retry_after_s))))
        if isinstance(exc, Unauthenticated):
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(error_body(exc.code, exc.message, exc.details),
                            status_code=status_for(exc), headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")),
                   "type": str(e.get("type", ""))} for e in exc.errors()]
        if any(e["type"] == "json_invalid" for e in errors):
            # The body is not JSON at all: a syntax error, not a schema violation.
            return JSONResponse(error_body("malformed_body", "request body is not valid JSON",
                                           {"errors": errors}), status_code=400)
        return JSONResponse(error_body("invalid_request", "request failed validation",
                                       {"errors": errors}), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))
