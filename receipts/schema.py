"""The receipt body: what an answer records so an operator can replay it exactly.

A body is a plain JSON object of sections (docs/receipts.md, "Format
(format_version 2)"). :func:`build_receipt_body` checks every required key and its type
and returns a fresh dict; :func:`validate_body` checks an existing one. The
chain fields (``id``, ``seq``, ``created_at``, ``prev_hash``, ``hash``) are set
by :func:`receipts.chain.append_receipt`, never by the caller.

Format history (``format_version``):

* 1: the sections below; canonical JSON is Python's ``json.dumps`` form
  (:func:`foundation.hashing.canonical_json`). Read and verified, never written.
* 2: canonical JSON per RFC 8785 (:mod:`receipts.canonical`); no integer
  beyond 2**53 - 1 anywhere (``candidates[].chunk_id`` is a decimal string,
  seeds are below 2**53); new fields ``request`` (every chat message, with its ``name``
  when the client sent one, and the client's ``user``), ``retrieval.query`` (the text retrieval embedded),
  ``generator.params.stop`` (stop sequences) and ``output.finish_reason`` /
  ``output.stop_sequence``.

Prompt slots (no version change: an optional candidate field, checked when present):
``candidates[].slot`` is the prompt slot ``[n]`` that showed the candidate's text. Candidates
with the same text share one slot (``app.prompting.slots``); slots open in rank order, 1, 2, ... A
receipt without ``slot`` (written before slots existed) showed one slot per candidate, in
rank order (:func:`candidate_slots`).

Prompt layout (no version change: an optional field, checked when present): ``prompt.layout``
is ``{"name": "rank" | "canonical", "slots": [slot numbers in the order the prompt showed them]}``
(``app.prompting.layout``); the prompt numbers them ``[1]``, ``[2]``, ... in that order. A receipt without
it showed its slots in rank order.

Engines (no version change: optional fields, checked when present): ``plan.engine_id`` and
``generator.engine_id`` name the configured engine the answer was routed to (``default`` on a
server with one engine), and ``plan.fleet`` is the fleet planner's choice on arrival
(``latency_model.fleet.FleetChoice.to_dict``: the engine, ``chosen_k``, ``fits`` and every
engine's ``predictions`` for the chosen k). A receipt without them was answered by the
server's one engine; replay regenerates it on the first configured engine.

Statuses: ``ok``; ``cancelled`` (the client left, or the server shut down); ``failed``
(generation failed after it started); ``interrupted`` (the serving process died while
the answer generated; written at the next start from the started-answer journal,
:mod:`receipts.journal`, with ``output`` null: nothing of the output is known).

Nullability: an answer that was cancelled, failed or interrupted still has a receipt, so
for ``status != "ok"`` every section except ``question``, ``corpus``,
``status`` and ``software`` may be ``null``; inside a section, fields marked
nullable (e.g. ``timings.ttft_ms`` before a first token) may be ``null`` for
any status. Extra keys inside a section are kept (forward compatible); unknown
top-level sections are rejected (put them under ``extra``).
"""

from __future__ import annotations

import math
from typing import Any

from foundation.errors import InvalidInput
from foundation.hashing import MAX_SAFE_INTEGER

FORMAT_VERSION = 2
FORMAT_VERSIONS = (1, 2)
STATUSES = ("ok", "cancelled", "failed", "interrupted")
PROFILE_SOURCES = ("fitted", "prior")
CHAIN_FIELDS = ("id", "seq", "created_at", "prev_hash", "hash", "format_version")

# Field specs: a type name, with a trailing "?" when null is allowed.
#   str, int (not bool), num (int or finite float), bool, dict, list, hash ("sha256:..." string),
#   any (any JSON value).
CANDIDATE = {"rank": "int", "score": "num", "chunk_id": "int", "document_id": "str",
             "version": "int", "chunk_hash": "str"}
FINISH_REASONS = ("stop", "length", "cancelled", "error")
ROLES = ("system", "developer", "user", "assistant")
MESSAGE = {"role": "str", "content": "str"}

SECTIONS: dict[str, dict[str, str]] = {
    "corpus": {"revision": "int", "root_hash": "str?"},
    "embedder": {"id": "str", "identity": "dict"},
    "retrieval": {"k_candidates": "int", "index": "dict", "query_truncated": "bool"},
    "plan": {"budget_ms": "num", "chosen_k": "int", "binding": "str?",
             "predicted_ttft_p50_ms": "num?", "predicted_ttft_p95_ms": "num?",
             "profile_id": "str?", "profile_source": "str", "overhead_ms": "num?", "rows": "list"},
    "scaffold": {"id": "any", "name": "str", "hash": "str"},
    "prompt": {"token_ids_hash": "str", "prompt_tokens": "int", "cached_tokens": "int",
               "computed_tokens": "int"},
    "generator": {"backend": "str", "model_id": "str", "weights_hash": "str?", "dtype": "str?",
                  "device": "str?", "params": "dict"},
    "timings": {"queue_ms": "num?", "ttft_ms": "num?", "tpot_ms": "num?", "retrieval_ms": "num?",
                "total_ms": "num?"},
    "output": {"text": "str", "text_hash": "str", "token_ids_hash": "str", "output_tokens": "int"},
    "software": {"python": "str?", "torch": "str?", "transformers": "str?",
                 "sentence_transformers": "str?", "faiss": "str?", "ragbudget": "str?"},
}
# Timings that answers record from the one request clock on (docs/latency_model.md, "Under load"):
# optional, so receipts written before them verify unchanged; checked when present.
OPTIONAL_TIMINGS = {"auth_ms": "num?", "planning_ms": "num?", "prefill_ms": "num?",
                    "overhead_ms": "num?"}
# The engine an answer was routed to (see the module docstring): optional, checked when present.
OPTIONAL_PLAN = {"engine_id": "str", "fleet": "dict?"}
OPTIONAL_GENERATOR = {"engine_id": "str"}
# The order the prompt showed its slots in (app.prompting.layout): optional, checked when present; a
# receipt without it showed them in rank order.
PROMPT_LAYOUT = {"name": "str", "slots": "list"}
FLEET_PREDICTION = {"engine_id": "str", "chosen_k": "int?", "predicted_wait_ms": "num",
                    "ttft_p50_ms": "num?", "ttft_p95_ms": "num?", "binding": "str?"}
GENERATION_PARAMS = {"max_new_tokens": "int", "temperature": "num", "top_p": "num", "seed": "int?"}
# What version 2 adds or changes, per section (checked on top of the version-1 specs).
V2_CANDIDATE = {**CANDIDATE, "chunk_id": "idstr"}
V2_SECTIONS: dict[str, dict[str, str]] = {
    "request": {"messages": "list", "user": "str?"},
    "retrieval": {"query": "str"},
    "output": {"finish_reason": "str", "stop_sequence": "str?"},
}
V2_GENERATION_PARAMS = {"stop": "list"}
# Sections that must be present and non-null whatever the status.
ALWAYS = ("corpus", "software")
# Optional sections: output.token_ids (list of ints) lets replay name the first differing token.
OPTIONAL_TOP = ("error", "extra")
TOP_LEVEL = ("question", "candidates", "status", *SECTIONS, *OPTIONAL_TOP)
V2_TOP_LEVEL = (*TOP_LEVEL, "request")


def _plain(value: Any) -> Any:
    """Turn numpy scalars and tuples into plain JSON values (recursively)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, str | bytes):
        return value.item()  # numpy scalar -> Python int/float/bool
    return value


def _check_json(value: Any, where: str, safe_integers: bool) -> None:
    """Reject values canonical JSON cannot carry exactly (NaN/inf, bytes, objects) and, with
    ``safe_integers``, integers beyond +-(2**53 - 1) (JavaScript would round them)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidInput(f"{where} must be a finite number, got {value!r}", field=where)
    if (safe_integers and isinstance(value, int) and not isinstance(value, bool)
            and abs(value) > MAX_SAFE_INTEGER):
        raise InvalidInput(f"{where} = {value} is beyond 2**53 - 1: an integer that large must be "
                           "a decimal string", field=where)
    if isinstance(value, dict):
        for k, v in value.items():
            _check_json(v, f"{where}.{k}", safe_integers)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, f"{where}[{i}]", safe_integers)
    elif not (value is None or isinstance(value, str | int | float | bool)):
        raise InvalidInput(f"{where} is not a JSON value: {type(value).__name__}", field=where)


def _check_type(value: Any, spec: str, where: str) -> None:
    nullable = spec.endswith("?")
    kind = spec.rstrip("?")
    if value is None:
        if nullable or kind == "any":
            return
        raise InvalidInput(f"{where} must not be null", field=where)
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "num": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "dict": isinstance(value, dict),
        "list": isinstance(value, list),
        "idstr": isinstance(value, str) and value.isascii() and value.isdigit()
        and value == str(int(value)),
        "any": True,
    }[kind]
    if not ok:
        raise InvalidInput(f"{where} must be {kind}, got {type(value).__name__}", field=where)


def _check_fields(section: Any, fields: dict[str, str], where: str) -> None:
    if not isinstance(section, dict):
        raise InvalidInput(f"{where} must be an object", field=where)
    missing = [f for f in fields if f not in section]
    if missing:
        raise InvalidInput(f"{where} is missing {', '.join(missing)}", field=where, missing=missing)
    for name, spec in fields.items():
        _check_type(section[name], spec, f"{where}.{name}")


def body_version(body: dict[str, Any]) -> int:
    """The format version a body claims (:data:`FORMAT_VERSION` when it has none yet).

    Raises:
        InvalidInput: ``format_version`` is not one of :data:`FORMAT_VERSIONS`.
    """
    version = body.get("format_version", FORMAT_VERSION)
    if isinstance(version, bool) or version not in FORMAT_VERSIONS:
        raise InvalidInput(f"unknown format_version {version!r}", field="format_version")
    return int(version)


def validate_body(body: dict[str, Any]) -> None:
    """Check a receipt body's required keys, types and values (chain fields are ignored).

    The rules are those of the body's ``format_version`` (the current version when
    the body has none yet, i.e. while it is being built).

    Raises:
        InvalidInput: a missing key, a wrong type, an unknown status, profile source,
            finish reason or message role, an unknown top-level section, or a value
            canonical JSON cannot represent (NaN, infinity, bytes; from version 2 also an
            integer beyond 2**53 - 1); ``details["field"]`` names the offending path.
    """
    if not isinstance(body, dict):
        raise InvalidInput("a receipt body must be an object")
    version = body_version(body)
    v2 = version >= 2
    unknown = sorted(set(body) - set(V2_TOP_LEVEL if v2 else TOP_LEVEL) - set(CHAIN_FIELDS))
    if unknown:
        raise InvalidInput(f"unknown receipt sections: {', '.join(unknown)} (use 'extra')",
                           field=unknown[0])
    _check_json(body, "body", safe_integers=v2)
    for key in ("question", "status", "candidates"):
        if key not in body:
            raise InvalidInput(f"receipt body is missing {key}", field=key)
    _check_type(body["question"], "str", "question")
    if body["status"] not in STATUSES:
        raise InvalidInput(f"status must be one of {', '.join(STATUSES)}", field="status")
    ok = body["status"] == "ok"
    _check_type(body["candidates"], "list", "candidates")
    for i, cand in enumerate(body["candidates"]):
        _check_fields(cand, V2_CANDIDATE if v2 else CANDIDATE, f"candidates[{i}]")
    _check_slots(body["candidates"])
    for name, fields in SECTIONS.items():
        if name not in body:
            raise InvalidInput(f"receipt body is missing {name}", field=name)
        if body[name] is None and not ok and name not in ALWAYS:
            continue
        _check_fields(body[name], fields, name)
    if body["plan"] is not None and body["plan"]["profile_source"] not in PROFILE_SOURCES:
        raise InvalidInput("plan.profile_source must be 'fitted' or 'prior'", field="plan.profile_source")
    if body["generator"] is not None:
        _check_fields(body["generator"]["params"], GENERATION_PARAMS, "generator.params")
    _check_engine(body)
    if body["timings"] is not None:
        for name, spec in OPTIONAL_TIMINGS.items():
            if name in body["timings"]:
                _check_type(body["timings"][name], spec, f"timings.{name}")
    out = body["output"]
    if out is not None and out.get("token_ids") is not None:
        _check_type(out["token_ids"], "list", "output.token_ids")
        for i, tok in enumerate(out["token_ids"]):
            _check_type(tok, "int", f"output.token_ids[{i}]")
    if body.get("error") is not None:
        _check_type(body["error"], "any", "error")
    if body.get("extra") is not None:
        _check_type(body["extra"], "dict", "extra")
    if v2:
        _validate_v2(body)


def _check_engine(body: dict[str, Any]) -> None:
    """The optional engine fields (:data:`OPTIONAL_PLAN`, :data:`OPTIONAL_GENERATOR`): typed when
    present, ``plan.fleet.predictions`` each a :data:`FLEET_PREDICTION`."""
    for section, specs in (("plan", OPTIONAL_PLAN), ("generator", OPTIONAL_GENERATOR)):
        got = body.get(section)
        if not isinstance(got, dict):
            continue
        for name, spec in specs.items():
            if name in got:
                _check_type(got[name], spec, f"{section}.{name}")
    layout = (body.get("prompt") or {}).get("layout") if isinstance(body.get("prompt"), dict) else None
    if layout is not None:
        _check_fields(layout, PROMPT_LAYOUT, "prompt.layout")
        for i, n in enumerate(layout["slots"]):
            _check_type(n, "int", f"prompt.layout.slots[{i}]")
        if sorted(layout["slots"]) != list(range(1, len(layout["slots"]) + 1)):
            raise InvalidInput("prompt.layout.slots must be a permutation of 1..k",
                               field="prompt.layout.slots")
    fleet = (body.get("plan") or {}).get("fleet")
    if isinstance(fleet, dict):
        _check_type(fleet.get("predictions"), "list", "plan.fleet.predictions")
        for i, pred in enumerate(fleet["predictions"]):
            _check_fields(pred, FLEET_PREDICTION, f"plan.fleet.predictions[{i}]")


def recorded_engine(body: dict[str, Any]) -> str | None:
    """The engine id a receipt records (``generator.engine_id``, else ``plan.engine_id``); None
    for a receipt from before engines were recorded (the server's one engine answered it)."""
    for section in ("generator", "plan"):
        got = body.get(section)
        if isinstance(got, dict) and isinstance(got.get("engine_id"), str):
            return str(got["engine_id"])
    return None


def _check_slots(candidates: list[dict[str, Any]]) -> None:
    """Recorded prompt slots: on every candidate or on none; each an int that is either the
    next slot (1, 2, ... in rank order) or one already opened by a candidate with the same
    chunk hash."""
    if not any("slot" in c for c in candidates):
        return
    opened: dict[int, str] = {}
    for i, cand in enumerate(candidates):
        where = f"candidates[{i}].slot"
        if "slot" not in cand:
            raise InvalidInput(f"{where} is missing: every candidate records its slot, or none does",
                               field=where)
        _check_type(cand["slot"], "int", where)
        slot = cand["slot"]
        if slot in opened:
            if opened[slot] != cand["chunk_hash"]:
                raise InvalidInput(f"{where} = {slot} shares a slot with a different chunk text",
                                   field=where)
        elif slot == len(opened) + 1:
            opened[slot] = cand["chunk_hash"]
        else:
            raise InvalidInput(f"{where} = {slot}: slots open in rank order, the next is "
                               f"{len(opened) + 1}", field=where)


def _validate_v2(body: dict[str, Any]) -> None:
    """The fields format version 2 adds (see the module docstring)."""
    if "request" not in body or body["request"] is None:
        raise InvalidInput("receipt body is missing request", field="request")
    for name, fields in V2_SECTIONS.items():
        if body.get(name) is not None:
            _check_fields(body[name], fields, name)
    for i, message in enumerate(body["request"]["messages"]):
        _check_fields(message, MESSAGE, f"request.messages[{i}]")
        if "name" in message:
            _check_type(message["name"], "str", f"request.messages[{i}].name")
        if message["role"] not in ROLES:
            raise InvalidInput(f"request.messages[{i}].role must be one of {', '.join(ROLES)}",
                               field=f"request.messages[{i}].role")
    if body["generator"] is not None:
        params = body["generator"]["params"]
        _check_fields(params, V2_GENERATION_PARAMS, "generator.params")
        for i, stop in enumerate(params["stop"]):
            _check_type(stop, "str", f"generator.params.stop[{i}]")
    if body["output"] is not None and body["output"]["finish_reason"] not in FINISH_REASONS:
        raise InvalidInput(f"output.finish_reason must be one of {', '.join(FINISH_REASONS)}",
                           field="output.finish_reason")


def build_receipt_body(**sections: Any) -> dict[str, Any]:
    """Assemble and validate a receipt body from its sections; return a new dict.

    Keyword arguments are the top-level sections (``question``, ``request``,
    ``corpus``, ``embedder``, ``retrieval``, ``candidates``, ``plan``,
    ``scaffold``, ``prompt``, ``generator``, ``timings``, ``output``, ``status``,
    ``error``, ``software``, optional ``extra``). numpy scalars are turned into
    plain numbers (a float32 score becomes the double with the same value, which
    JSON round-trips exactly); candidates' ``chunk_id`` integers become decimal
    strings. ``error`` defaults to ``None``; ``format_version`` is set to
    :data:`FORMAT_VERSION`.

    Raises:
        InvalidInput: see :func:`validate_body`; also when a chain field is passed.
    """
    passed = sorted(set(sections) & set(CHAIN_FIELDS))
    if passed:
        raise InvalidInput(f"chain fields are set by the chain, not the caller: {', '.join(passed)}",
                           field=passed[0])
    body = _plain(dict(sections))
    for cand in body.get("candidates") or []:
        if isinstance(cand, dict) and isinstance(cand.get("chunk_id"), int) \
                and not isinstance(cand["chunk_id"], bool):
            cand["chunk_id"] = str(cand["chunk_id"])
    body.setdefault("error", None)
    validate_body(body)
    body["format_version"] = FORMAT_VERSION
    return body  # type: ignore[no-any-return]


def candidate_slots(body: dict[str, Any]) -> list[int]:
    """Each candidate's prompt slot, in rank order: as recorded (``candidates[].slot``), else
    (a receipt from before slots) one slot per candidate, ``1..K``."""
    cands = list(body.get("candidates") or [])
    if cands and all("slot" in c for c in cands):
        return [int(c["slot"]) for c in cands]
    return list(range(1, len(cands) + 1))


def cited_candidates(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The candidates the model was shown: those in the first ``plan.chosen_k`` prompt slots
    (:func:`candidate_slots`; every copy of a shown text included), none when there is no plan."""
    plan = body.get("plan")
    if plan is None:
        return []
    k = int(plan.get("chosen_k") or 0)
    cands = list(body.get("candidates") or [])
    return [c for c, slot in zip(cands, candidate_slots(body), strict=True) if slot <= k]


def document_versions(body: dict[str, Any]) -> list[tuple[str, int]]:
    """Distinct ``(document_id, version)`` pairs among a body's candidates, sorted.

    These are the ``receipt_documents`` rows written with the receipt (the index
    behind "receipts citing document X"), and what verification expects to find.
    """
    return sorted({(str(c["document_id"]), int(c["version"])) for c in body.get("candidates") or []})


def retrieval_query(body: dict[str, Any]) -> str:
    """The text retrieval embedded: ``retrieval.query`` (version 2), else the question (version 1)."""
    query = (body.get("retrieval") or {}).get("query")
    return query if isinstance(query, str) else str(body["question"])
