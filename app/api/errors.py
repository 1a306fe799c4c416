"""HTTP mapping of ragbudget errors: status codes live here and nowhere else."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

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


def install_error_handlers(app: FastAPI) -> None:
    """Map ``RagBudgetError`` and request validation errors to JSON 4xx responses."""

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
        return JSONResponse(error_body("invalid_request", "request failed validation",
                                       {"errors": errors}), status_code=422)
