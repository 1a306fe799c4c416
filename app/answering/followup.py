"""A follow-up turn that continues the earlier turn token for token, and its replay.

A chat follow-up sends its conversation so far: earlier messages, then the assistant's answer,
then the new question. Laid out as text turns (``[scaffold][earlier turns as text][chunks]
[question]``), its prompt shares only the scaffold with the earlier turn's own prompt
(``[scaffold][its chunks][its question]``), so the engine's prefix cache cannot serve the
earlier turn. When the history is exactly what an earlier receipt answered, its request
messages followed by its answer text (:func:`receipts.turns.find_turn`, an index lookup), the
follow-up's prompt instead starts with that answer's exact prompt ids (its chunks included)
and its exact generated ids, then the end of the turn, the new user header, the new chunks,
the new question and the assistant header (:meth:`app.prompting.prompt.PromptBuilder.build`,
``earlier``). The block cache then serves every whole block of the earlier turn that an
earlier answer computed (docs/engines.md, "Follow-up turns").

Which layout was used is recorded in the receipt (``prompt.conversation``, :func:`conversation_record`):
``{"layout": "earlier_turn", "receipt_id", "prefix_tokens", "earlier_prompt_tokens"}`` or
``{"layout": "text", "fallback": <why>}`` with ``fallback`` one of :data:`FALLBACKS`.

The earlier turn's ids are never stored: they are rebuilt from its receipt like replay rebuilds
them (:func:`rebuild_prompt`: the recorded scaffold, conversation, cited chunks from the
store, slots and layout; recursively for an earlier turn that was a follow-up itself), and
checked against the receipt's own hashes (body hash, prompt token-id hash, output token-id
hash): an earlier turn that does not verify is not continued (``fallback``
``earlier_turn_unverified``). Replay of a follow-up rebuilds the same way, so the prompt it
rebuilds is the prompt the answer was shown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app.prompting.conversation import EarlierTurn, Turn
from foundation.errors import IntegrityFailure, NotFound, RagBudgetError
from foundation.hashing import sha256_ints

if TYPE_CHECKING:
    from app.models import Scaffold
    from app.prompting.prompt import Prompt
    from app.services import Services

#: Why a conversation was laid out as text turns rather than continuing its earlier turn.
FALLBACKS = ("no_earlier_answer", "no_matching_receipt", "other_scaffold", "other_model",
             "earlier_turn_not_ok", "stop_sequence", "earlier_turn_unverified", "window",
             "text_layout_set")
#: Receipts followed back through a conversation at most (each a rebuild); a longer chain of
#: follow-ups is laid out as text (``earlier_turn_unverified``).
MAX_DEPTH = 64


def rebuild_prompt(services: Services, body: dict[str, Any], hits: list[Any], *, depth: int = 0) -> Prompt:
    """The prompt ``body``'s answer was shown, token for token, from ``hits`` (its cited
    chunks, rank order, :func:`receipts.stored.stored_hits`): the recorded scaffold (looked up
    by hash), conversation (``request.messages`` before the question), slots, layout and question;
    for a follow-up that continued an earlier turn (``prompt.conversation.layout ==
    "earlier_turn"``), that turn's ids rebuilt and verified first (:func:`earlier_turn`).

    Raises:
        NotFound: the recorded scaffold is not stored (``unknown_scaffold``), or the earlier receipt
            is gone (``UnknownReceipt``).
        IntegrityFailure: the earlier turn does not verify against its receipt.
    """
    from app.prompting.prompt import scaffold_by_hash
    from app.prompting.slots import prompt_slots

    sc = body["scaffold"]
    row = scaffold_by_hash(services.engine, sc["hash"])
    if row is None:
        raise NotFound(f"scaffold {sc['hash']} is not stored", code="unknown_scaffold")
    builder = services.prompt_builder  # the generator's tokenizer, without loading the model
    slots = [_attr(h, "slot") for h in hits]
    # the recorded slots (app.prompting.slots); a receipt from before slots showed one per candidate
    chunks = prompt_slots(hits, slots if all(n is not None for n in slots) else list(range(1, len(hits) + 1)))
    messages = (body.get("request") or {}).get("messages") or []
    history = [Turn(m["role"], m["content"]) for m in messages[:-1]]
    recorded = body.get("prompt") or {}
    layout = recorded.get("layout") or {}  # a receipt without it showed rank order
    order = layout.get("slots")
    conv = recorded.get("conversation") or {}
    earlier = None
    if conv.get("layout") == "earlier_turn":
        earlier = earlier_turn(services, str(conv["receipt_id"]), depth=depth + 1)
        if earlier.prefix_tokens != conv.get("prefix_tokens"):
            raise IntegrityFailure(
                f"the earlier turn {earlier.receipt_id} rebuilds to {earlier.prefix_tokens} tokens, "
                f"the receipt recorded {conv.get('prefix_tokens')}", receipt_id=earlier.receipt_id)
    return builder.build(row.text, chunks, body["question"], history,
                         order=[int(n) for n in order] if order is not None else None,
                         layout=str(layout.get("name", "rank")), earlier=earlier)


def earlier_turn(services: Services, receipt_id: str, *, depth: int = 0) -> EarlierTurn:
    """The exact prompt and output ids of receipt ``receipt_id``, rebuilt and verified: its body
    hash, its prompt rebuilt (:func:`rebuild_prompt`) to its recorded prompt token-id hash, its
    recorded output ids (``output.token_ids``) to its output token-id hash.

    Raises:
        UnknownReceipt: no such receipt.
        IntegrityFailure: any of those differs, a cited chunk is missing or changed, the
            receipt has no output ids, or the conversation is more than :data:`MAX_DEPTH`
            follow-ups deep.
        NotFound: as :func:`rebuild_prompt`.
    """
    from receipts.chain import get_receipt, receipt_hash
    from receipts.stored import stored_hits

    if depth > MAX_DEPTH:
        raise IntegrityFailure(f"the conversation is more than {MAX_DEPTH} follow-ups deep")
    body = get_receipt(services.engine, receipt_id)
    if receipt_hash({k: v for k, v in body.items() if k != "hash"}) != body.get("hash"):
        raise IntegrityFailure(f"receipt {receipt_id} does not match its hash", receipt_id=receipt_id)
    hits, problems = stored_hits(services.engine, body)
    if problems:
        raise IntegrityFailure(f"receipt {receipt_id}'s cited chunks changed: {problems[0]['detail']}",
                               receipt_id=receipt_id)
    prompt = rebuild_prompt(services, body, hits, depth=depth)
    if prompt.prompt_hash != body["prompt"]["token_ids_hash"]:
        raise IntegrityFailure(f"receipt {receipt_id}'s prompt does not rebuild to its hash",
                               receipt_id=receipt_id)
    out = body.get("output") or {}
    ids = out.get("token_ids")
    if not isinstance(ids, list) or sha256_ints(ids) != out.get("token_ids_hash"):
        raise IntegrityFailure(f"receipt {receipt_id}'s output ids are missing or do not match "
                               "their hash", receipt_id=receipt_id)
    return EarlierTurn(receipt_id, tuple(prompt.ids), tuple(int(i) for i in ids))


def find_earlier_turn(services: Services, history: list[Turn], scaffold: Scaffold,
                      model_ids: set[str]) -> tuple[EarlierTurn | None, str | None]:
    """The earlier turn a chat request with ``history`` continues, or why none.

    Returns ``(turn, None)`` when ``history`` (its roles and contents) is exactly an earlier
    receipt's request messages followed by its answer text (:func:`receipts.turns.find_turn`,
    the latest such receipt), that receipt was answered with ``scaffold`` by a model in
    ``model_ids`` (the engines in rotation), with status ``ok`` and no stop string cutting its
    text, and its ids rebuild and verify (:func:`earlier_turn`). Otherwise ``(None, reason)``,
    ``reason`` one of :data:`FALLBACKS`; ``(None, None)`` for a request without history.
    """
    from receipts.chain import get_receipt
    from receipts.turns import find_turn

    if not history:
        return None, None
    if history[-1].role != "assistant":
        return None, "no_earlier_answer"
    rid = find_turn(services.engine, [t.to_dict() for t in history])
    if rid is None:
        return None, "no_matching_receipt"
    try:
        body = get_receipt(services.engine, rid)
    except RagBudgetError:
        return None, "no_matching_receipt"
    if (body.get("scaffold") or {}).get("hash") != scaffold.hash:
        return None, "other_scaffold"
    if (body.get("generator") or {}).get("model_id") not in model_ids:
        return None, "other_model"
    if body.get("status") != "ok":
        return None, "earlier_turn_not_ok"
    if (body.get("output") or {}).get("stop_sequence") is not None:
        return None, "stop_sequence"  # its ids run past the text the client was shown
    try:
        return earlier_turn(services, rid), None
    except RagBudgetError:
        return None, "earlier_turn_unverified"


def fits_window(full: Prompt, max_new: int, window: int) -> bool:
    """True when ``full``'s prompt without a new chunk (``k = 0``) leaves ``max_new`` output
    tokens in a ``window``-token context: else the follow-up drops the earlier turn's exact
    tokens first (it is laid out as text turns, ``fallback`` ``window``), before any new chunk."""
    return window - full.prompt_tokens_for(0) >= max_new


def conversation_record(prompt: Prompt, history: list[Turn], fallback: str | None) -> dict[str, Any] | None:
    """``prompt.conversation`` of the receipt (module docstring); None without history."""
    if prompt.earlier is not None:
        return {"layout": "earlier_turn", **prompt.earlier.record()}
    if not history:
        return None
    return {"layout": "text", "fallback": fallback or "no_earlier_answer"}


def _attr(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)

