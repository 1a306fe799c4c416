"""Chat framing: the text a chat template puts around the system and user contents.

A chat template (:mod:`generation.chat_template` decides which one) is rendered
once with placeholder contents and split at the placeholders
(:func:`derive_framing`); the plain-completion layout has a fixed framing
(:func:`plain_framing`). :func:`check_assistant_turn` refuses a template whose
prompt would not end by opening the assistant's turn. :func:`find_markers` lists the marker-like strings that
:class:`app.prompting.prompt.PromptBuilder` requires to be special tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from foundation.errors import InvalidConfig
from retrieval.tokens import TextTokenizer

PLAIN_ANSWER_CUE = "\n\nAnswer:"
# Marker-like strings in a rendered template: <|name|> and <name> / </name> (no spaces).
_MARKER = re.compile(r"<\|[^<>|\s]{1,64}\|>|</?[A-Za-z_][A-Za-z0-9_.:-]{0,63}>")
_SYS_PH = "\u0000SYS\u0000"
_USR_PH = "\u0000USR\u0000"
_ASST_PH = "\u0000ASST\u0000"
_USR2_PH = "\u0000USR2\u0000"


# --- chat framing -------------------------------------------------------------------------
@dataclass(frozen=True)
class ChatFraming:
    """Template text around the system and user contents.

    ``system_supported`` False (templates that reject a system turn): the scaffold
    text opens the user turn instead, followed by a blank line.
    """

    system_prefix: str
    system_to_user: str
    user_suffix: str
    system_supported: bool = True


def render_chat_template(source: str, messages: list[dict[str, str]], **context: Any) -> str:
    """Render a Jinja chat template as transformers does (sandboxed, trim/lstrip blocks); with the
    generation prompt (the text that opens the assistant's turn) unless ``context`` sets
    ``add_generation_prompt=False``."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def strftime_now(fmt: str) -> str:  # pragma: no cover - only templates that print dates
        return datetime.now(UTC).strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return str(env.from_string(source).render(messages=messages, **{"add_generation_prompt": True,
                                                                     **context}))


def derive_framing(source: str, special_tokens: dict[str, str] | None = None) -> ChatFraming:
    """Split a chat template into the text before/between/after the system and user contents.

    Raises:
        InvalidConfig: the template does not echo the message contents verbatim.
    """
    ctx = dict(special_tokens or {})
    try:
        text = render_chat_template(source, [{"role": "system", "content": _SYS_PH},
                                             {"role": "user", "content": _USR_PH}], **ctx)
        once = text.count(_SYS_PH) == 1 and text.count(_USR_PH) == 1
        if once and text.index(_SYS_PH) < text.index(_USR_PH):
            head, rest = text.split(_SYS_PH)
            mid, tail = rest.split(_USR_PH)
            return ChatFraming(head, mid, tail, True)
    except Exception:  # noqa: BLE001 - templates may refuse a system turn; try without
        pass
    text = render_chat_template(source, [{"role": "user", "content": _USR_PH}], **ctx)
    if text.count(_USR_PH) != 1:
        raise InvalidConfig("the chat template does not contain the message content verbatim")
    head, tail = text.split(_USR_PH)
    return ChatFraming(head, "\n\n", tail, False)


def check_assistant_turn(source: str, special_tokens: dict[str, str] | None = None) -> None:
    """Refuse a chat template whose prompt does not end where the assistant's turn starts.

    The model writes the answer after the prompt, so the prompt must end by opening an
    assistant turn (the template's ``add_generation_prompt`` block). Rendered for one user
    message, the template must therefore

    1. add text that is not only whitespace when ``add_generation_prompt`` is true (a
       template without that block ends the prompt inside the user's turn, where the
       model's most likely next token ends the turn: every answer comes back empty);
    2. when it can render an assistant message, end where that message's content would
       begin (one of the two a prefix of the other: templates may add an empty thinking
       block to the generation prompt, or to the rendered turn).

    Raises:
        InvalidConfig (``chat_template_no_assistant_turn``): either rule is broken.
    """
    ctx = dict(special_tokens or {})
    user = [{"role": "user", "content": _USR_PH}]
    prompt = render_chat_template(source, user, **ctx)
    without = render_chat_template(source, user, add_generation_prompt=False, **ctx)
    fix = ("Give the template an {% if add_generation_prompt %} block that opens the assistant's "
           "turn, or use the model's own or a bundled template (RAGBUDGET_CHAT_TEMPLATE)")
    if prompt.rstrip() == without.rstrip():
        raise InvalidConfig("the chat template has no generation prompt: rendered with "
                            "add_generation_prompt it ends where the user's turn ends, so the model "
                            f"would be asked to continue the user's turn and answer nothing. {fix}",
                            code="chat_template_no_assistant_turn", rule="generation_prompt")
    try:
        turn = render_chat_template(source, [*user, {"role": "assistant", "content": _ASST_PH}],
                                    add_generation_prompt=False, **ctx)
    except Exception:  # noqa: BLE001 - a template that cannot render an assistant turn: rule 1 only
        return
    if turn.count(_ASST_PH) != 1:
        return
    opener = turn[:turn.index(_ASST_PH)]
    if not (opener.startswith(prompt) or prompt.startswith(opener)):
        raise InvalidConfig("the chat template's generation prompt does not open the assistant's "
                            f"turn: the prompt ends {prompt[-40:]!r}, an assistant turn starts "
                            f"{opener[-40:]!r}. {fix}", code="chat_template_no_assistant_turn",
                            rule="assistant_turn")


def _leading_bos_text(tokenizer: TextTokenizer) -> str:
    """The BOS token's text when the tokenizer puts one in front of every text (Gemma, Llama), else ""."""
    hf: Any = getattr(tokenizer, "hf", None)
    bos = getattr(hf, "bos_token", None) if hf is not None else None
    bos_id = getattr(hf, "bos_token_id", None) if hf is not None else None
    if hf is None or not isinstance(bos, str) or bos_id is None:
        return ""
    try:
        ids = hf("x")["input_ids"]
    except Exception:  # noqa: BLE001 - a tokenizer that cannot add specials adds no BOS
        return ""
    return bos if ids and ids[0] == bos_id else ""


def plain_framing(tokenizer: TextTokenizer) -> ChatFraming:
    """The plain-completion layout: ``[BOS]scaffold``, a blank line, the user text, ``\\n\\nAnswer:``."""
    return ChatFraming(_leading_bos_text(tokenizer), "\n\n", PLAIN_ANSWER_CUE, True)


def find_markers(text: str) -> list[str]:
    """Marker-like strings in ``text`` (``<|name|>``, ``<name>``, ``</name>``), sorted, unique."""
    return sorted(set(_MARKER.findall(text)))


@dataclass(frozen=True)
class TurnFraming:
    """Template text between earlier turns: after a user content up to the assistant content
    (``user_to_assistant``), and after an assistant content up to the next user content."""

    user_to_assistant: str
    assistant_to_user: str


def derive_turn_framing(source: str, special_tokens: dict[str, str] | None = None,
                        system_supported: bool = True) -> TurnFraming | None:
    """Split a chat template rendered for ``[system,] user, assistant, user`` at the contents.

    Returns None when the template does not render such a conversation with each
    content verbatim and in order (a conversation with earlier assistant turns then
    cannot be laid out; see :meth:`app.prompting.prompt.PromptBuilder.build`).
    """
    messages = [{"role": "user", "content": _USR_PH}, {"role": "assistant", "content": _ASST_PH},
                {"role": "user", "content": _USR2_PH}]
    if system_supported:
        messages.insert(0, {"role": "system", "content": _SYS_PH})
    try:
        text = render_chat_template(source, messages, **dict(special_tokens or {}))
    except Exception:  # noqa: BLE001 - a template that refuses this conversation
        return None
    marks = [_USR_PH, _ASST_PH, _USR2_PH]
    if any(text.count(m) != 1 for m in marks):
        return None
    at = [text.index(m) for m in marks]
    if at != sorted(at):
        return None
    return TurnFraming(user_to_assistant=text[at[0] + len(_USR_PH):at[1]],
                       assistant_to_user=text[at[1] + len(_ASST_PH):at[2]])
