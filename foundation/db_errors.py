"""The one place where database and driver errors become ragbudget errors.

A value that slipped past :mod:`foundation.bounds` and was refused by the driver or
the server (psycopg's ``DataError``: NUL in text, a number out of range, an invalid
datetime), a constraint a concurrent writer won, or a database that cannot be reached
would otherwise surface as a plain 500 (API) or a traceback (CLI). The API's error
handlers and the CLI's entry point both call :func:`translate_db_error`.

Mapping (SQLAlchemy wraps every DB-API exception in the class of the same name):

==============================================  ===============================  =========
driver / SQLAlchemy error                       ragbudget error (code)           HTTP/exit
==============================================  ===============================  =========
``DataError``; ``StatementError`` not from the  ``InvalidInput`` (``invalid_value``)  422 / 2
driver (a parameter that cannot be encoded)
``IntegrityError``                              ``Conflict`` (``conflict``)          409 / 1
``OperationalError``, ``InterfaceError``,       ``Unavailable``                      503 / 1
``DisconnectionError``, ``TimeoutError`` (pool)  (``database_unavailable``)
any other ``SQLAlchemyError``                   ``RagBudgetError`` (``database_error``) 500 / 1
==============================================  ===============================  =========

The original message's first line is kept in ``details["driver_message"]`` (without
the SQL text or its parameters, which may hold a caller's data).
"""

from __future__ import annotations

from sqlalchemy import exc as sa_exc

from foundation.errors import Conflict, InvalidInput, RagBudgetError, Unavailable


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip()
    return (text.splitlines() or [""])[0][:300]


def translate_db_error(exc: sa_exc.SQLAlchemyError) -> RagBudgetError:
    """The ragbudget error for a database error (see the module table). Never raises."""
    message = _first_line(exc)
    details = {"driver_message": message, "driver_error": type(getattr(exc, "orig", None) or exc).__name__}
    if isinstance(exc, sa_exc.DataError):
        return InvalidInput(f"the database refused a value: {message}", code="invalid_value", **details)
    if isinstance(exc, sa_exc.IntegrityError):
        return Conflict(f"a concurrent writer changed the same data; retry: {message}", **details)
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.DisconnectionError
                  | sa_exc.TimeoutError):
        return Unavailable(f"the database is unavailable: {message}", **details)
    if isinstance(exc, sa_exc.StatementError) and not isinstance(exc, sa_exc.DBAPIError):
        return InvalidInput(f"a value cannot be sent to the database: {message}", code="invalid_value",
                            **details)
    return RagBudgetError(f"database error: {message}", code="database_error", **details)
