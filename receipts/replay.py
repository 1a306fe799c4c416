"""Replay a receipt: verify it, re-run its retrieval, rebuild its prompt, optionally regenerate.

Checks, in order (each ``{name, status, ok, expected, actual, detail}``):

1. ``receipt_hash``: the body's hash recomputed from the stored body equals the
   recorded one (body and row); ``chain_link``: its ``prev_hash`` is the previous
   receipt's hash and the next receipt (if any) links to it.
2. ``corpus_root``: the pinned revision still has the recorded root hash;
   ``retrieval``: retrieval of the recorded query (``retrieval.query``; the
   question in version 1) re-run at that revision with the recorded K returns
   identical chunk ids, ranks, document versions, chunk hashes and scores
   (exact float equality); ``embedder``: the retriever's embedder id equals the
   recorded one.
3. ``stored_chunks``: the cited chunks are still in the store, in the recorded
   document versions, with the recorded hashes; ``prompt``: the prompt rebuilt
   from them (``rebuild_prompt``, injected by ``app``) has the recorded token-id
   hash and token count. A follow-up that continued its earlier turn
   (``prompt.conversation``) rebuilds that turn's prompt and output ids from its own receipt,
   verified against its hashes; an earlier receipt gone or not verifying fails this check.
4. ``regenerate`` (optional, injected by ``app``): the regenerated output token
   ids equal the recorded ones; on a difference the report gives the first
   differing token position, the tokens around it on both sides
   (``actual.context``: ``start``, ``position``, ``recorded`` and ``regenerated``
   token ids from ``start``) and the recorded environment fields that differ.

A check whose hook is not available is ``skipped`` (it does not fail the
replay). An ``interrupted`` receipt (:mod:`receipts.journal`) replays steps 1-3 like any
other (what the model was shown); step 4 is ``skipped``: no output was recorded to compare.
The report also carries the receipt's freshness.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, select

from foundation.db import read_session
from foundation.errors import IntegrityFailure, RagBudgetError, UnknownReceipt
from receipts.chain import GENESIS, get_receipt_row, parse_body, receipt_hash
from receipts.freshness import freshness, render_freshness
from receipts.models import ReceiptRow
from receipts.schema import retrieval_query
from receipts.stored import stored_hits
from retrieval.models import Revision

RebuildPrompt = Callable[[dict[str, Any], list[Any]], tuple[str, int]]
Regenerate = Callable[[dict[str, Any]], dict[str, Any]]
HIT_FIELDS = ("rank", "chunk_id", "document_id", "version", "chunk_hash", "score")
# Around the first differing output token (or character), this many on each side are reported.
CONTEXT_TOKENS = 8
CONTEXT_CHARS = 40


@dataclass
class Check:
    """One replay check. ``skipped`` checks neither pass nor fail the replay."""

    name: str
    ok: bool
    expected: Any = None
    actual: Any = None
    detail: str = ""
    skipped: bool = False

    @property
    def status(self) -> str:
        """``skipped``, ``ok`` or ``failed``."""
        return "skipped" if self.skipped else ("ok" if self.ok else "failed")

    def to_dict(self) -> dict[str, Any]:
        """``{name, status, ok, expected, actual, detail}``, JSON-ready when expected/actual are."""
        return {"name": self.name, "status": self.status, "ok": self.ok, "expected": self.expected,
                "actual": self.actual, "detail": self.detail}


@dataclass
class ReplayReport:
    """Everything a replay found. ``ok``: no check failed."""

    receipt_id: str
    seq: int
    checks: list[Check] = field(default_factory=list)
    freshness: dict[str, Any] | None = None
    elapsed_ms: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no check failed (skipped checks neither pass nor fail)."""
        return all(c.ok or c.skipped for c in self.checks)

    def check(self, name: str) -> Check:
        """The check called ``name``. Raises KeyError when it was not run."""
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        """``{receipt_id, seq, ok, checks, freshness, elapsed_ms}`` (ms rounded to 0.001), the
        shape ``POST /v1/receipts/{id}/replay`` answers."""
        return {"receipt_id": self.receipt_id, "seq": self.seq, "ok": self.ok,
                "checks": [c.to_dict() for c in self.checks], "freshness": self.freshness,
                "elapsed_ms": round(self.elapsed_ms, 3)}

    def render(self) -> str:
        """Human-readable report: one line per check, expected/actual for failures, freshness."""
        lines = [f"replay of {self.receipt_id} (seq {self.seq}): {'OK' if self.ok else 'FAILED'}"]
        for c in self.checks:
            lines.append(f"  [{c.status:^7}] {c.name:<14} {c.detail}")
            if not c.ok and not c.skipped:
                lines.append(f"            expected {_short(c.expected)}")
                lines.append(f"            actual   {_short(c.actual)}")
        if self.freshness is not None:
            lines.append(render_freshness(self.freshness))
        return "\n".join(lines)


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def _hit_tuple(hit: Any) -> dict[str, Any]:
    """A hit's identifying fields; ``chunk_id`` as a decimal string (version 2 records it so,
    version 1 and the retriever as an int)."""
    out = {f: _get(hit, f) for f in HIT_FIELDS}
    if out["chunk_id"] is not None:
        out["chunk_id"] = str(out["chunk_id"])
    return out


def check_chain(engine: Engine, row: Any, body: dict[str, Any]) -> list[Check]:
    """Step 1: the receipt's own hash and both of its links, to its real neighbours.

    The neighbours are the nearest receipts that exist (largest ``seq`` below, smallest
    above), not ``seq - 1`` and ``seq + 1``: a deleted neighbour is reported as
    missing receipts, never as "(head)". A receipt whose body records another
    position than the one it is stored at (rows swapped or renumbered) fails too.
    """
    recomputed = receipt_hash(body)
    hash_ok = recomputed == body.get("hash") == row.hash
    checks = [Check("receipt_hash", hash_ok, row.hash, recomputed,
                    "hash recomputed from the stored body" + ("" if hash_ok else " differs"))]
    with read_session(engine) as session:
        prev = session.execute(select(ReceiptRow.seq, ReceiptRow.hash).where(ReceiptRow.seq < row.seq)
                               .order_by(ReceiptRow.seq.desc()).limit(1)).first()
        nxt = session.execute(select(ReceiptRow.seq, ReceiptRow.prev_hash).where(ReceiptRow.seq > row.seq)
                              .order_by(ReceiptRow.seq).limit(1)).first()
    problems = []
    claimed = body.get("seq")
    if claimed != row.seq:
        problems.append(f"the receipt stored at position {row.seq} records position {claimed!r}")
    expected_prev: str | None
    if row.seq == 1:
        expected_prev = GENESIS
    elif prev is None:
        expected_prev = None
        problems.append(f"previous receipt{' 1' if row.seq == 2 else f's 1..{row.seq - 1}'} missing")
    elif prev.seq != row.seq - 1:
        expected_prev = prev.hash
        gap = f" {row.seq - 1}" if prev.seq == row.seq - 2 else f"s {prev.seq + 1}..{row.seq - 1}"
        problems.append(f"previous receipt{gap} missing")
    else:
        expected_prev = prev.hash
    if expected_prev is not None and body.get("prev_hash") != expected_prev and (prev is None or
                                                                                 prev.seq == row.seq - 1):
        problems.append("prev_hash is not the previous receipt's hash")
    if nxt is not None:
        if nxt.seq != row.seq + 1:
            gap = f" {row.seq + 1}" if nxt.seq == row.seq + 2 else f"s {row.seq + 1}..{nxt.seq - 1}"
            problems.append(f"next receipt{gap} missing (next present: {nxt.seq})")
        elif nxt.prev_hash != row.hash:
            problems.append("the next receipt does not link to this one")
    detail = "; ".join(problems) or ("linked to the previous receipt"
                                      + (" and the next one" if nxt is not None else " (head)"))
    checks.append(Check("chain_link", not problems, expected_prev, body.get("prev_hash"), detail))
    return checks


def check_retrieval(engine: Engine, body: dict[str, Any], retriever: Any) -> list[Check]:
    """Step 2: the pinned revision's root hash, the re-run retrieval, the embedder id."""
    revision = body["corpus"]["revision"]
    with read_session(engine) as session:
        root = session.scalar(select(Revision.root_hash).where(Revision.number == revision))
    checks = [Check("corpus_root", root == body["corpus"]["root_hash"], body["corpus"]["root_hash"], root,
                    f"root hash of revision {revision}" + ("" if root else " (revision not found)"))]
    if retriever is None:
        checks.append(Check("retrieval", False, skipped=True, detail="no retriever available"))
        return checks
    k = int(body["retrieval"]["k_candidates"])
    try:
        result = retriever.retrieve(retrieval_query(body), k, revision)
    except RagBudgetError as exc:
        checks.append(Check("retrieval", False, None, exc.to_dict(), f"retrieval failed: {exc.message}"))
        return checks
    expected = [_hit_tuple(c) for c in body["candidates"]]
    actual = [_hit_tuple(h) for h in _get(result, "hits", [])]
    if expected == actual:
        checks.append(Check("retrieval", True, len(expected), len(actual),
                            f"{len(actual)} candidates at revision {revision}: identical ids, order, scores"))
    else:
        pos = next((i for i, (e, a) in enumerate(zip(expected, actual, strict=False)) if e != a),
                   min(len(expected), len(actual)))
        exp = expected[pos] if pos < len(expected) else None
        act = actual[pos] if pos < len(actual) else None
        fields = sorted(f for f in HIT_FIELDS if _get(exp or {}, f) != _get(act or {}, f))
        checks.append(Check("retrieval", False, exp, act,
                            f"first difference at rank {pos + 1} ({', '.join(fields)}); "
                            f"{len(expected)} recorded, {len(actual)} now"))
    embedder_id = _get(result, "embedder_id")
    if embedder_id is None:
        checks.append(Check("embedder", False, body["embedder"]["id"], None, skipped=True,
                            detail="the retriever does not report its embedder id"))
    else:
        ok = embedder_id == body["embedder"]["id"]
        checks.append(Check("embedder", ok, body["embedder"]["id"], embedder_id,
                            "same embedder identity" if ok else "a different embedder (weights or config)"))
    return checks


def check_prompt(engine: Engine, body: dict[str, Any], rebuild_prompt: RebuildPrompt | None) -> list[Check]:
    """Step 3: the cited chunks as stored, and the prompt rebuilt from them."""
    hits, problems = stored_hits(engine, body)
    detail = "; ".join(f"rank {p['rank']} chunk {p['chunk_id']}: {p['detail']}" for p in problems)
    checks = [Check("stored_chunks", not problems, len(hits) + len(problems), len(hits),
                    detail or f"{len(hits)} cited chunks intact in the store")]
    if body.get("prompt") is None:
        checks.append(Check("prompt", False, skipped=True, detail="no prompt was recorded (failed early)"))
    elif rebuild_prompt is None:
        checks.append(Check("prompt", False, skipped=True, detail="prompt rebuild not available"))
    elif problems:
        checks.append(Check("prompt", False, skipped=True, detail="cited chunks are not intact"))
    else:
        rec = body["prompt"]
        try:
            token_ids_hash, prompt_tokens = rebuild_prompt(body, hits)
        except (IntegrityFailure, UnknownReceipt) as exc:
            # a follow-up whose earlier turn (prompt.conversation) is gone or does not verify
            checks.append(Check("prompt", False, {"token_ids_hash": rec["token_ids_hash"],
                                                  "prompt_tokens": rec["prompt_tokens"]}, None,
                                f"the prompt cannot be rebuilt: {exc}"))
            return checks
        ok = (token_ids_hash, prompt_tokens) == (rec["token_ids_hash"], rec["prompt_tokens"])
        checks.append(Check("prompt", ok, {"token_ids_hash": rec["token_ids_hash"],
                                           "prompt_tokens": rec["prompt_tokens"]},
                            {"token_ids_hash": token_ids_hash, "prompt_tokens": prompt_tokens},
                            f"rebuilt {prompt_tokens} prompt tokens from the stored versions"
                            + ("" if ok else ": token ids differ")))
    return checks


def recorded_environment(body: dict[str, Any]) -> dict[str, Any]:
    """The environment fields a regeneration depends on, as recorded."""
    gen = body.get("generator") or {}
    env = {f"generator.{k}": gen.get(k) for k in ("backend", "model_id", "weights_hash", "dtype", "device")}
    if (gen.get("engine") or {}).get("precision"):  # the local engine's compute precision, when recorded
        env["generator.precision"] = gen["engine"]["precision"]
    env.update({f"software.{k}": v for k, v in (body.get("software") or {}).items()})
    return env


def environment_diff(recorded: dict[str, Any], current: dict[str, Any]) -> list[dict[str, Any]]:
    """Fields present in both whose values differ: ``[{"field", "recorded", "current"}]``."""
    return [{"field": k, "recorded": recorded[k], "current": current[k]}
            for k in sorted(recorded) if current.get(k) is not None and current[k] != recorded[k]]


def check_regenerate(body: dict[str, Any], regenerate: Regenerate | None,
                     current_environment: dict[str, Any] | None) -> Check:
    """Step 4: regenerate with the recorded parameters and compare output tokens.

    ``regenerate(body)`` returns ``{"token_ids": [...] (optional), "token_ids_hash",
    "text", "environment": {"generator.device": ..., "software.torch": ..., ...}}``.
    """
    if regenerate is None:
        return Check("regenerate", False, skipped=True, detail="regeneration not available")
    out = body.get("output")
    if out is None:
        why = ("the answer was interrupted (its process died mid-answer): there is no output to compare"
               if body.get("status") == "interrupted" else "no output was recorded")
        return Check("regenerate", False, skipped=True, detail=why)
    got = regenerate(body)
    env = dict(current_environment or {})
    env.update(got.get("environment") or {})
    diff = environment_diff(recorded_environment(body), env)
    rec_ids, new_ids = out.get("token_ids"), got.get("token_ids")
    if body.get("status") == "cancelled" and rec_ids is not None and new_ids is not None:
        ok = new_ids[: len(rec_ids)] == rec_ids  # a cancelled answer recorded a prefix
    else:
        ok = got.get("token_ids_hash") == out["token_ids_hash"]
    expected = {"token_ids_hash": out["token_ids_hash"], "output_tokens": out["output_tokens"]}
    actual = {"token_ids_hash": got.get("token_ids_hash"),
              "output_tokens": len(new_ids) if new_ids is not None else None}
    if ok:
        detail = "identical output tokens"
    elif rec_ids is not None and new_ids is not None:
        pos = next((i for i, (a, b) in enumerate(zip(rec_ids, new_ids, strict=False)) if a != b),
                   min(len(rec_ids), len(new_ids)))
        actual["first_differing_token"] = pos
        start = max(0, pos - CONTEXT_TOKENS)
        actual["context"] = {"start": start, "position": pos,
                             "recorded": rec_ids[start:pos + CONTEXT_TOKENS],
                             "regenerated": new_ids[start:pos + CONTEXT_TOKENS]}
        detail = f"output differs from token {pos}"
    else:
        rec_text, new_text = out.get("text") or "", got.get("text") or ""
        pos = next((i for i, (a, b) in enumerate(zip(rec_text, new_text, strict=False)) if a != b),
                   min(len(rec_text), len(new_text)))
        actual["first_differing_char"] = pos
        start = max(0, pos - CONTEXT_CHARS)
        actual["context"] = {"start": start, "position": pos,
                             "recorded_text": rec_text[start:pos + CONTEXT_CHARS],
                             "regenerated_text": new_text[start:pos + CONTEXT_CHARS]}
        detail = f"output differs from character {pos} (token ids were not recorded)"
    actual["environment_diff"] = diff
    if not ok:
        detail += ("; environment differs: " + ", ".join(d["field"] for d in diff) if diff
                   else "; same recorded environment")
    return Check("regenerate", ok, expected, actual, detail)


def replay(engine: Engine, receipt_id: str, *, retriever: Any,
           rebuild_prompt: RebuildPrompt | None, regenerate: Regenerate | None = None,
           current_environment: dict[str, Any] | None = None,
           want_regenerate: bool | None = None) -> ReplayReport:
    """Replay ``receipt_id`` (steps 1-4 in the module docstring) and report every check.

    Args:
        retriever: has ``retrieve(query, k, revision)`` returning a result with ``hits``
            (and ``embedder_id``); ``None`` skips the retrieval check.
        rebuild_prompt: ``(body, cited hits) -> (token_ids_hash, prompt_tokens)``; the hits
            are :class:`receipts.stored.StoredHit` in rank order; ``None`` skips step 3.
        regenerate: ``body -> {...}`` (see :func:`check_regenerate`); ``None`` skips step 4.
        current_environment: this process's environment in :func:`recorded_environment`'s
            keys, compared when the output differs.
        want_regenerate: run step 4 (default: when ``regenerate`` is given); True without a
            ``regenerate`` hook reports step 4 as skipped.

    Raises:
        UnknownReceipt: no receipt has that id.
    """
    start = time.perf_counter()
    row = get_receipt_row(engine, receipt_id)
    body = parse_body(row.body)
    report = ReplayReport(receipt_id=receipt_id, seq=row.seq)
    report.checks += check_chain(engine, row, body)
    report.checks += check_retrieval(engine, body, retriever)
    report.checks += check_prompt(engine, body, rebuild_prompt)
    if want_regenerate if want_regenerate is not None else regenerate is not None:
        report.checks.append(check_regenerate(body, regenerate, current_environment))
    report.freshness = freshness(engine, body)
    report.elapsed_ms = (time.perf_counter() - start) * 1000.0
    return report
