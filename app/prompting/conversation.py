"""A chat conversation before its last question: the turns the prompt shows and the retrieval query.

An OpenAI chat request carries a list of messages; the last one is the user's
question, the ones before it are the conversation. Two things are derived from
them here, both deterministic and recorded in the receipt (``request.messages``,
``retrieval.query``) so replay rebuilds them exactly:

* :func:`prompt_turns`: the turns the prompt lays out after the scaffold
  (:meth:`app.prompting.prompt.PromptBuilder.build`). System and developer messages,
  joined by blank lines, open the first user turn (the scaffold already is the
  system turn, and must stay the cached prefix); consecutive messages of one
  role are merged, joined by a blank line, so user and assistant turns
  alternate; an assistant message first is preceded by an empty user turn.
* :func:`retrieval_query`: what retrieval embeds. A follow-up such as "And what
  is its default?" names no topic, so the query is the last user message
  followed by the earlier user messages, newest first, up to
  :data:`QUERY_USER_MESSAGES` messages, one per line. The question comes first
  so that when the embedder truncates a long query (256 word pieces for
  all-MiniLM-L6-v2, recorded as ``retrieval.query_truncated``) the oldest
  context is what is cut. Assistant answers are left out: they are the model's
  words, not the user's topic, and may be wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from foundation.errors import InvalidInput

#: Roles whose content instructs (laid out at the start of the first user turn).
SYSTEM_ROLES = ("system", "developer")
#: Roles of the turns themselves.
TURN_ROLES = ("user", "assistant")
#: User messages (the question and the ones before it) that make up a retrieval query.
QUERY_USER_MESSAGES = 3


@dataclass(frozen=True)
class Turn:
    """One message as text: ``role`` is system, developer, user or assistant; ``name`` the
    participant's name an OpenAI client may send (LangChain ``HumanMessage(name=...)``, agent
    names), recorded in the receipt and not shown to the model (:meth:`to_dict`)."""

    role: str
    content: str
    name: str | None = None

    def to_dict(self) -> dict[str, str]:
        """``{"role", "content"}``, the chat-message shape a chat template takes (no ``name``:
        the prompt is the same with or without one)."""
        return {"role": self.role, "content": self.content}

    def record(self) -> dict[str, str]:
        """The message as the receipt records it (``request.messages``): ``{"role", "content"}``
        and ``"name"`` when the client sent one."""
        return {**self.to_dict(), **({"name": self.name} if self.name is not None else {})}


def check_roles(messages: list[Turn]) -> None:
    """Raises InvalidInput (``unsupported_role``, ``details.index``) for a role not in
    :data:`SYSTEM_ROLES` + :data:`TURN_ROLES`."""
    for i, turn in enumerate(messages):
        if turn.role not in SYSTEM_ROLES + TURN_ROLES:
            raise InvalidInput(f"unsupported message role {turn.role!r}", code="unsupported_role",
                               index=i)


def prompt_turns(history: list[Turn]) -> list[Turn]:
    """The alternating user/assistant turns that ``history`` becomes (see the module docstring).

    The first turn, when there is one, is a user turn (it continues the user turn
    the scaffold opened). Empty when ``history`` is empty.

    Raises:
        InvalidInput (``unsupported_role``): see :func:`check_roles`.
    """
    check_roles(history)
    instructions = "\n\n".join(t.content for t in history if t.role in SYSTEM_ROLES)
    turns: list[Turn] = [Turn("user", instructions)] if instructions else []
    for turn in (t for t in history if t.role in TURN_ROLES):
        if turns and turns[-1].role == turn.role:
            turns[-1] = Turn(turn.role, turns[-1].content + "\n\n" + turn.content)
        elif not turns and turn.role == "assistant":
            turns = [Turn("user", ""), turn]
        else:
            turns.append(turn)
    return turns


def retrieval_query(question: str, history: list[Turn]) -> str:
    """The text retrieval embeds for ``question`` asked after ``history`` (module docstring)."""
    earlier = [t.content.strip() for t in reversed(history) if t.role == "user" and t.content.strip()]
    return "\n".join([question, *earlier[:QUERY_USER_MESSAGES - 1]])


@dataclass(frozen=True)
class EarlierTurn:
    """The earlier turn a follow-up continues token for token (``app.answering.followup``).

    ``receipt_id``: the receipt that answered it; ``prompt_ids``: that answer's exact prompt
    (its scaffold, conversation and chunks included), ``answer_ids``: the exact token ids it
    generated. The follow-up's prompt starts with ``prompt_ids + answer_ids``
    (:meth:`app.prompting.prompt.PromptBuilder.build`, ``earlier``), so the engine's prefix cache
    serves the whole previous turn.
    """

    receipt_id: str
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]

    @property
    def prefix_tokens(self) -> int:
        """``len(prompt_ids) + len(answer_ids)``: the tokens the follow-up repeats exactly."""
        return len(self.prompt_ids) + len(self.answer_ids)

    def record(self) -> dict[str, Any]:
        """What the receipt records of it (``prompt.conversation``, with ``layout``)."""
        return {"receipt_id": self.receipt_id, "prefix_tokens": self.prefix_tokens,
                "earlier_prompt_tokens": len(self.prompt_ids)}
