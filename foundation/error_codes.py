"""Every public error code of ragbudget, in one enumeration.

A code is what clients branch on: the ``code`` of an error body
(``{"error": {"code", "message", "details"}}``), of a CLI ``--json`` error, of a
rejected ingest item, of a failed answer and of an interrupted receipt. Each
member of :class:`ErrorCode` is the code string itself (a ``StrEnum``) and carries:

* ``raised_as``: the :mod:`foundation.errors` class that carries it (its own
  ``code``, or a more general class given ``code=...``); None for a code written
  into a body directly (an HTTP-layer answer, a per-item or per-answer error);
* ``http_status``: the status an error response with this code answers with on
  ragbudget's routes (the OpenAI-compatible routes answer 400 where this says 422);
  None when the code never makes an error response (it is reported inside a 200
  body or by the CLI only). The status is mapped at the edge (``app.api.errors``)
  and stated here because ``foundation`` imports nothing of ``app``;
  ``tests/test_error_codes.py`` checks every statement against that mapping;
* ``retry``: whether sending the same request again can help (after Retry-After
  where one is sent); False means the request, the data or the settings must change;
* ``meaning``: one line for the docs.

``python -m foundation.error_codes --markdown`` prints the table of ``docs/errors.md``;
``--update docs/errors.md`` rewrites that table in place. ``tests/test_error_codes.py``
finds every code the rooms use (an AST walk) and fails on one missing here, on a member
nothing uses, and on a ``docs/errors.md`` that differs from the generated table.

To add a code: add a member below (name = the code in capitals), run
``python -m foundation.error_codes --update docs/errors.md``, commit both.
"""

from __future__ import annotations

import argparse
import sys
from enum import StrEnum
from pathlib import Path

from foundation.errors import (
    AuthError,
    BackendError,
    BudgetUnreachable,
    Busy,
    Conflict,
    ContextLengthExceeded,
    EmptyContent,
    Forbidden,
    IntegrityFailure,
    InvalidConfig,
    InvalidDocumentId,
    InvalidEncoding,
    InvalidInput,
    NotFound,
    RagBudgetError,
    TooLarge,
    Unauthenticated,
    Unavailable,
    UnknownDocument,
    UnknownModel,
    UnknownProfile,
    UnknownReceipt,
    UnknownRevision,
    UnknownVersion,
    UnsupportedParameter,
    UnsupportedType,
)

#: The markers around the generated table in ``docs/errors.md``.
BEGIN = "<!-- error-codes:begin (generated: python -m foundation.error_codes --update docs/errors.md) -->"
END = "<!-- error-codes:end -->"


class ErrorCode(StrEnum):
    """Every public error code; each member is the code string (see the module docstring)."""

    raised_as: type[RagBudgetError] | None
    http_status: int | None
    retry: bool
    meaning: str

    def __new__(cls, value: str, raised_as: type[RagBudgetError] | None, http_status: int | None,
                retry: bool, meaning: str) -> ErrorCode:
        member = str.__new__(cls, value)
        member._value_ = value
        member.raised_as = raised_as
        member.http_status = http_status
        member.retry = retry
        member.meaning = meaning
        return member

    # --- the error tree's own codes (foundation/errors.py) -----------------------------
    RAGBUDGET_ERROR = ("ragbudget_error", RagBudgetError, 500, False,
                       "an error of ragbudget's own with no more specific code")
    INVALID_INPUT = ("invalid_input", InvalidInput, 422, False,
                     "bad request data with no more specific code; nothing was written")
    UNSUPPORTED_PARAMETER = ("unsupported_parameter", UnsupportedParameter, 400, False,
                             "a request field or value ragbudget refuses rather than ignores "
                             "(`details.param` names it)")
    EMPTY_CONTENT = ("empty_content", EmptyContent, 422, False,
                     "a document with no visible text after extraction and normalisation")
    INVALID_ENCODING = ("invalid_encoding", InvalidEncoding, 422, False,
                        "bytes that the encoding they are read in cannot decode (byte-order mark, an "
                        "HTML page's declared charset, else UTF-8), an unknown declared charset, or "
                        "NUL bytes without a byte-order mark (`details.offset`: the first bad byte)")
    INVALID_FRONT_MATTER = ("invalid_front_matter", InvalidInput, 422, False,
                            "a Markdown document's front matter (between `---` lines at its top) "
                            "is not valid YAML; refused rather than indexed as text")
    FRONT_MATTER_TOO_LARGE = ("front_matter_too_large", TooLarge, 413, False,
                              "a Markdown document's front matter holds more values than the limit "
                              "once YAML aliases are expanded (`details.limit`)")
    UNSUPPORTED_TYPE = ("unsupported_type", UnsupportedType, 422, False,
                        "a file suffix or document kind the extractor does not handle")
    TOO_LARGE = ("too_large", TooLarge, 413, False,
                 "a body, document or batch over its configured limit (`details.limit`)")
    INVALID_DOCUMENT_ID = ("invalid_document_id", InvalidDocumentId, 422, False,
                           "a document id that breaks the id grammar (`details.rule`)")
    INVALID_CONFIG = ("invalid_config", InvalidConfig, 500, False,
                      "the server's settings or model files cannot work (a misconfiguration, "
                      "not the caller's fault); the CLI exits 2")
    NOT_FOUND = ("not_found", NotFound, 404, False,
                 "no such object, path or route")
    MODEL_NOT_FOUND = ("model_not_found", UnknownModel, 404, False,
                       "a model id this server does not serve (`GET /v1/models` lists those it does)")
    UNKNOWN_DOCUMENT = ("unknown_document", UnknownDocument, 404, False,
                        "no such document id, or no live version of it where one is needed")
    UNKNOWN_VERSION = ("unknown_version", UnknownVersion, 404, False,
                       "the document exists but has no such version")
    UNKNOWN_REVISION = ("unknown_revision", UnknownRevision, 404, False,
                        "no corpus revision with that number")
    UNKNOWN_RECEIPT = ("unknown_receipt", UnknownReceipt, 404, False,
                       "no receipt with that id")
    UNKNOWN_PROFILE = ("unknown_profile", UnknownProfile, 404, False,
                       "no latency profile with that id or prefix")
    CONFLICT = ("conflict", Conflict, 409, True,
                "a concurrent writer got there first")
    BUSY = ("busy", Busy, 429, True,
            "a bounded queue is full; come back after Retry-After")
    BUDGET_UNREACHABLE = ("budget_unreachable", BudgetUnreachable, 503, True,
                          "even k = 0 is predicted over the TTFT budget and the request asked to be "
                          "refused (`on_budget_miss: reject`); when the wait rules it out, Retry-After "
                          "(when the model is free) and `x-should-retry: true`; when k = 0 alone is "
                          "over the budget on an idle model (`details.retryable` false), "
                          "`x-should-retry: false` and no Retry-After")
    AUTH_ERROR = ("auth_error", AuthError, 500, False,
                  "an authentication or authorisation failure with no more specific code")
    UNAUTHENTICATED = ("unauthenticated", Unauthenticated, 401, False,
                       "no valid API key was presented, or it was revoked")
    FORBIDDEN = ("forbidden", Forbidden, 403, False,
                 "the API key's role does not allow this route")
    INTEGRITY_FAILURE = ("integrity_failure", IntegrityFailure, 409, False,
                         "stored data does not verify: a hash, a chain link or an index checksum differs")
    BACKEND_ERROR = ("backend_error", BackendError, 500, True,
                     "the model or a remote engine failed while serving the request")
    DATABASE_UNAVAILABLE = ("database_unavailable", Unavailable, 503, True,
                            "the database cannot be reached or refused the connection")

    # --- bad input, by what is wrong (InvalidInput and TooLarge with a code) ----------------
    EMPTY_QUESTION = ("empty_question", InvalidInput, 422, False,
                      "the question is empty, whitespace-only or invisible-only")
    QUESTION_TOO_LONG = ("question_too_long", TooLarge, 413, False,
                         "the question is longer than `max_question_chars`")
    EMPTY_QUERY = ("empty_query", InvalidInput, 422, False,
                   "the retrieval query is empty or whitespace-only")
    QUERY_TOO_LONG = ("query_too_long", TooLarge, 413, False,
                      "the retrieval query is longer than `max_question_chars`")
    INVALID_BUDGET = ("invalid_budget", InvalidInput, 422, False,
                      "`ttft_budget_ms` (or `--budgets`) is not a finite number in the allowed range")
    INVALID_K = ("invalid_k", InvalidInput, 422, False,
                 "`k` or `k_max` is not an integer in [1, `max_k`]")
    INVALID_MAX_NEW_TOKENS = ("invalid_max_new_tokens", InvalidInput, 422, False,
                              "`max_new_tokens` is outside [1, `max_new_tokens_limit`]")
    INVALID_ON_BUDGET_MISS = ("invalid_on_budget_miss", InvalidInput, 422, False,
                              "`on_budget_miss` is neither `answer` nor `reject`")
    INVALID_SAMPLING_PARAMETER = ("invalid_sampling_parameter", InvalidInput, 422, False,
                                  "a sampling parameter out of its range or of the wrong type "
                                  "(`details.param`, `details.value`)")
    INVALID_STOP = ("invalid_stop", InvalidInput, 422, False,
                    "a stop sequence that is empty, not a string or too long, or too many of them")
    INVALID_REQUEST = ("invalid_request", InvalidInput, 422, False,
                       "the request body breaks its schema (an unknown field, a wrong type); "
                       "`details.errors` lists each problem")
    INVALID_MESSAGE = ("invalid_message", InvalidInput, 422, False,
                       "a chat message with a role or content ragbudget cannot take")
    LAST_MESSAGE_NOT_USER = ("last_message_not_user", InvalidInput, 422, False,
                             "the last chat message is not the user's question")
    UNSUPPORTED_ROLE = ("unsupported_role", InvalidInput, 422, False,
                        "a conversation turn whose role is not system, developer, user or assistant")
    CONTEXT_LENGTH_EXCEEDED = ("context_length_exceeded", ContextLengthExceeded, 422, False,
                               "the prompt, or the prompt with the output tokens asked for, does not "
                               "fit the model's context window; refused before queueing (400 in "
                               "OpenAI's shape on the OpenAI routes)")
    TOO_MANY_DOCUMENTS = ("too_many_documents", TooLarge, 413, False,
                          "more documents in one ingest batch than the limit (`details.limit`)")
    INVALID_VALUE = ("invalid_value", InvalidInput, 422, False,
                     "the database refused a value (out of range, NUL in text, a bad datetime)")
    INVALID_FORM = ("invalid_form", InvalidInput, 422, False,
                    "a console form that is not `application/x-www-form-urlencoded` or is too large")
    INVALID_REPEATS = ("invalid_repeats", InvalidInput, 422, False,
                       "`ragbudget sweep --repeats` is below 1")
    NO_QUESTIONS = ("no_questions", InvalidInput, 422, False,
                    "a sweep's question file holds no questions")
    INVALID_LABELS = ("invalid_labels", InvalidInput, 422, False,
                      "a sweep's relevance-label file cannot be read or names unknown questions")
    NO_BOOKINDEX = ("no_bookindex", InvalidInput, 422, False,
                    "the corpus has no `bookindex.html` to sample sweep questions from "
                    "(`ragbudget corpus fetch postgres-docs`)")

    # --- not found, by what is missing --------------------------------------------------
    UNKNOWN_KEY = ("unknown_key", NotFound, 404, False,
                   "no API key with that id")
    UNKNOWN_ENGINE = ("unknown_engine", NotFound, 404, False,
                      "an engine id (a receipt's recorded engine, `ragbudget calibrate --engine`) "
                      "that is not in the configured engine list (`RAGBUDGET_ENGINES`)")
    FIRST_TOKEN_TIMEOUT = ("first_token_timeout", BackendError, 500, True,
                           "a remote engine sent no first token within what the plan allowed "
                           "(`engine_first_token_margin_ms`); it is taken out of rotation and the "
                           "answer is retried once elsewhere when budget is left, else it fails "
                           "with this code and its receipt")
    ENGINE_UNAVAILABLE = ("engine_unavailable", Unavailable, 503, True,
                          "every configured engine is out of rotation (refusing connections); "
                          "each is probed and rejoins when it answers again; Retry-After is the "
                          "next probe (`details.retry_after_s`)")
    UNKNOWN_SCAFFOLD = ("unknown_scaffold", NotFound, 404, False,
                        "a receipt's scaffold is not stored, so its prompt cannot be rebuilt")
    CORPUS_UNAVAILABLE = ("corpus_unavailable", NotFound, 404, True,
                          "the real corpus's package is neither on disk nor downloadable now "
                          "(`apt-get download` failed or is missing; `--deb PATH` gives one)")

    # --- refused by role or by the console's guards ----------------------------------------
    CONSOLE_ROLE = ("console_role", Forbidden, 403, False,
                    "the console needs an operator or admin key")
    CSRF_FAILED = ("csrf_failed", Forbidden, 403, False,
                   "a console form from another origin, an opaque origin, or without a valid "
                   "CSRF token; reload the page and send it again")

    # --- the server's settings and model --------------------------------------------------
    NO_CHAT_TEMPLATE = ("no_chat_template", InvalidConfig, 500, False,
                        "the model has no chat template and none is configured, or the configured "
                        "file cannot be used (`RAGBUDGET_CHAT_TEMPLATE`)")
    CHAT_TEMPLATE_NO_ASSISTANT_TURN = ("chat_template_no_assistant_turn", InvalidConfig, 500, False,
                                       "the chat template cannot open an assistant turn (no "
                                       "generation prompt): refused at start, never served empty")
    CHAT_TEMPLATE_MISMATCH = ("chat_template_mismatch", InvalidConfig, 500, False,
                              "the chat template uses a marker that is not a special token of the "
                              "model's tokenizer (`details.marker`)")
    PROMPT_MISMATCH = ("prompt_mismatch", BackendError, 500, False,
                       "the remote engine's tokenizer does not read the prompt's special tokens as "
                       "ragbudget does; the prompt is never sent")
    SAMPLING_FAILED = ("sampling_failed", BackendError, 500, False,
                       "the model's logits for one answer cannot be sampled (non-finite, or every "
                       "token masked); that answer fails, the others in its batch go on")
    DATABASE_ERROR = ("database_error", RagBudgetError, 500, False,
                      "any other database error (`details.driver_message`)")
    INTERNAL_ERROR = ("internal_error", RagBudgetError, 500, False,
                      "an unexpected error; the server log (or `RAGBUDGET_DEBUG=1` on the CLI) "
                      "has the traceback")

    # --- answered by the HTTP layer before any route ----------------------------------------
    MALFORMED_BODY = ("malformed_body", None, 400, False,
                      "the request body is not JSON at all")
    BAD_HTTP_REQUEST = ("bad_http_request", None, 400, False,
                        "the bytes are not a valid HTTP/1.1 request (answered by the server's parser)")
    BODY_TOO_LARGE = ("body_too_large", None, 413, False,
                      "the request body is over `max_body_bytes` (`details.limit`)")
    METHOD_NOT_ALLOWED = ("method_not_allowed", None, 405, False,
                          "the path exists but not with this HTTP method")
    UNSUPPORTED_MEDIA_TYPE = ("unsupported_media_type", None, 415, False,
                              "the request's Content-Type is not one the route takes")
    HTTP_ERROR = ("http_error", None, None, False,
                  "any other HTTP-layer refusal, with the status the framework chose")

    # --- inside a 200 body: an ingest item, a failed answer, a receipt ----------------------
    SYMLINK_OUTSIDE = ("symlink_outside", None, None, False,
                       "an ingest item refused: a symbolic link out of the ingest directory "
                       "(`--follow-symlinks` follows it)")
    SYMLINK_LOOP = ("symlink_loop", None, None, False,
                    "an ingest item skipped: a symbolic link to one of its own ancestor directories "
                    "(a loop; its files are ingested once, under their real path)")
    DUPLICATE_DIRECTORY = ("duplicate_directory", None, None, False,
                           "an ingest item skipped: a link to a directory already walked; its "
                           "files are ingested once, under the path reached first")
    DUPLICATE_FILE = ("duplicate_file", None, None, False,
                      "an ingest item skipped: a link (or second hard link) to a file already "
                      "taken; the reason names the document id that has it")
    SYMLINK_NOT_FOLLOWED = ("symlink_not_followed", None, None, False,
                            "an ingest item skipped: a link to a directory inside the folder that "
                            "was not walked (a hidden one); `--follow-symlinks` follows it")
    BROKEN_SYMLINK = ("broken_symlink", None, None, False,
                      "an ingest item refused: a dangling symbolic link, or one the system cannot "
                      "resolve (a link to itself)")
    NOT_REGULAR_FILE = ("not_regular_file", None, None, False,
                        "an ingest item refused: neither a regular file nor a directory "
                        "(a FIFO, a device, a socket)")
    UNREADABLE = ("unreadable", None, None, False,
                  "an ingest item refused: the file cannot be read (permissions, I/O error)")
    GENERATION_FAILED = ("generation_failed", None, None, True,
                         "an answer failed after its stream started (`status: failed`, or an "
                         "`error` event in a stream); the receipt records it")
    INTERRUPTED = ("interrupted", None, None, True,
                   "a receipt's answer was cut off because its serving process ended; recorded "
                   "at the next start, no output is known")


def markdown_table() -> str:
    """The code table of ``docs/errors.md``: one row per :class:`ErrorCode` member, in order.

    Columns: code, HTTP status (``-`` when the code never makes an error response),
    whether a retry can help, the error class that carries it, meaning.
    """
    rows = ["| code | HTTP | retry helps | raised as | meaning |", "|---|---|---|---|---|"]
    for code in ErrorCode:
        status = str(code.http_status) if code.http_status is not None else "-"
        raised = f"`{code.raised_as.__name__}`" if code.raised_as is not None else "-"
        rows.append(f"| `{code.value}` | {status} | {'yes' if code.retry else 'no'} | {raised} "
                    f"| {code.meaning} |")
    return "\n".join(rows) + "\n"


def with_table(text: str) -> str:
    """``text`` (a markdown document) with the part between :data:`BEGIN` and :data:`END`
    replaced by :func:`markdown_table`.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the document lacks the markers {BEGIN!r} ... {END!r}")
    return text[:start + len(BEGIN)] + "\n" + markdown_table() + text[end:]


def main(argv: list[str] | None = None) -> int:
    """``--markdown``: print the table; ``--update PATH``: rewrite PATH's table in place."""
    parser = argparse.ArgumentParser(prog="python -m foundation.error_codes",
                                     description="ragbudget's public error codes")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="print the markdown table")
    group.add_argument("--update", type=Path, metavar="PATH",
                       help="rewrite the table between the markers of PATH (docs/errors.md)")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
        return 0
    path: Path = args.update
    path.write_text(with_table(path.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
