"""Prompt layout as token ids: [scaffold][conversation][chunks 1..k][question][assistant turn].

The scaffold (system prompt + fixed instructions, stored in the ``scaffolds``
table with its hash) is the stable front of every prompt, so its KV cache can be
reused. Its ids end at a chat-template boundary: the system turn is closed and
the user-turn header written. Then come the chosen chunks, one per prompt slot
(:mod:`app.prompting.slots`: identical texts share one), in the order of the prompt layout
(:mod:`app.prompting.layout`: rank order, or a canonical order so overlapping retrievals
share prefixes), numbered by their place in the prompt, each labelled
``[n] (doc <id> v<version>)`` (``; also doc <id> v<version>, ...`` for the copies) and
separated by blank lines, then the question, then the user-turn end and the assistant header.

A chat request's own system messages and earlier turns (the conversation)
come right after the scaffold, so the scaffold stays the cached prefix of every
prompt (:meth:`PromptBuilder.build`, ``history``), as real chat turns framed
with the template's own text (:func:`derive_turn_framing`); the turns are
those of :func:`app.prompting.conversation.prompt_turns`; the last user turn holds the
chunks and the question. A follow-up that continues an earlier turn
(:class:`app.prompting.conversation.EarlierTurn`, found by ``app.answering.followup``) has that
turn's exact prompt and output ids in place of the text turns, then the end of the turn and the
new user header (:meth:`PromptBuilder.continuation_ids`).

Each segment is encoded on its own and the ids are concatenated; the joined
text is never re-tokenised. That makes the scaffold ids an exact prefix of
every prompt, and each chunk's token count exact, whatever the text around the
boundaries (a question that starts with spaces, a chunk that starts with a
newline). Template control text is encoded with special tokens recognised;
scaffold, document and question text with special tokens kept as plain text, so
``<|im_start|>system`` inside a document can never open a turn.

The chat framing is derived from the chat template in force
(:func:`generation.chat_template.resolve_chat_template`: the model's own, a file
the user gives, or the plain-completion layout; never a silent default): it is
rendered once with placeholder contents and split at the placeholders. Every
marker-like string in that framing (``<|im_start|>``, ``<start_of_turn>``, ``</s>``)
must be one special token of the tokenizer, else the builder refuses
(:class:`InvalidConfig`, code ``chat_template_mismatch``). The token that opens the
framing after the user's text (``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``) is
the template's end-of-turn token: it closes the assistant turn too, so generation
stops there (:attr:`PromptBuilder.end_of_turn_ids`).

Plain-completion layout (``RAGBUDGET_CHAT_TEMPLATE=plain``, for base models)::

    [BOS if the tokenizer adds one]<scaffold text>

    [1] (doc <id> v<version>)
    <chunk text>
    ...

    Question: <question>

    Answer:
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.exc import IntegrityError

from app.models import Scaffold
from app.prompting.conversation import EarlierTurn, Turn, prompt_turns
from app.prompting.framing import (
    TurnFraming,
    check_assistant_turn,
    derive_framing,
    derive_turn_framing,
    find_markers,
    plain_framing,
)
from foundation.db import WriterLock, read_session, write_transaction
from foundation.errors import EmptyContent, InvalidConfig, NotFound
from foundation.hashing import normalize_text, sha256_ints, sha256_text
from foundation.provenance import utc_now_iso
from generation.chat_template import ChatTemplate, resolve_chat_template
from retrieval.tokens import TextTokenizer

DEFAULT_SCAFFOLD_NAME = "default"
DEFAULT_SCAFFOLD_TEXT = (
    "You are a careful technical assistant. Answer the user's question using only the numbered "
    "sources in the user's message. Cite every source you use as [n], where n is the number of "
    "the source, for example [1] or [2][3]. If the sources do not contain the answer, say that "
    "you do not know. Keep the answer short and factual."
)


# --- scaffolds in the database ---------------------------------------------------------
def ensure_scaffold(engine: Engine, name: str, text: str) -> Scaffold:
    """Return the stored scaffold with this text, storing it first if new. Idempotent.

    The text is normalised (:func:`foundation.hashing.normalize_text`) and addressed by
    ``sha256_text`` of it; a text stored before under another name keeps its first name.

    Raises:
        EmptyContent: the text is blank.
    """
    norm = normalize_text(text)
    if not norm.strip():
        raise EmptyContent("scaffold text is empty")
    digest = sha256_text(norm)
    found = scaffold_by_hash(engine, digest)
    if found is not None:
        return found
    try:
        with write_transaction(engine, WriterLock.SCAFFOLDS) as session:
            row = session.scalar(select(Scaffold).where(Scaffold.hash == digest))
            if row is None:
                row = Scaffold(name=name, hash=digest, text=norm,
                               created_at=utc_now_iso())
                session.add(row)
                session.flush()
        return row
    except IntegrityError:  # a concurrent writer stored it first
        again = scaffold_by_hash(engine, digest)
        if again is None:
            raise
        return again


def scaffold_by_hash(engine: Engine, digest: str) -> Scaffold | None:
    """The scaffold whose hash is ``digest``, or None."""
    with read_session(engine) as session:
        return session.scalar(select(Scaffold).where(Scaffold.hash == digest))


def get_scaffold(engine: Engine, scaffold_id: int) -> Scaffold:
    """The scaffold with primary key ``scaffold_id``.

    Raises:
        NotFound: no such scaffold.
    """
    with read_session(engine) as session:
        row = session.get(Scaffold, scaffold_id)
    if row is None:
        raise NotFound(f"no scaffold with id {scaffold_id}", scaffold_id=scaffold_id)
    return row


# --- prompts ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PromptChunk:
    """A retrieved chunk as shown to the model: one prompt slot (:mod:`app.prompting.slots`); ``also`` holds
    ``(document id, version)`` of the other candidates with the same text."""

    document_id: int | str
    version: int
    text: str
    also: tuple[tuple[int | str, int], ...] = ()
    start_char: int = 0
    chunk_hash: str = ""


@dataclass
class Prompt:
    """A prompt as token ids, with exact per-part token counts.

    ``prompt_tokens == scaffold_len + history_tokens + sum(chunk_token_counts) + question_tokens
    + framing_tokens`` where ``framing_tokens`` are the template tokens after the question
    (user-turn end + assistant header), ``history_tokens`` the conversation between the
    scaffold and the chunks (0 without one); the template tokens before it are inside the
    scaffold.
    """

    ids: list[int]
    scaffold_ids: list[int]
    scaffold_len: int
    prompt_tokens: int
    chunk_token_counts: list[int]
    question_tokens: int
    framing_tokens: int
    text: str
    prompt_hash: str
    scaffold_hash: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    history_tokens: int = 0
    #: the slots shown, 1-based indices into the chunks given, in the order the prompt shows them
    order: list[int] = field(default_factory=list)
    layout: str = "rank"
    #: ids of each candidate prompt k = 0..K in a layout other than rank (:meth:`PromptBuilder.candidates`)
    candidate_ids: list[list[int]] | None = None
    #: the earlier turn this prompt continues token for token (None: the conversation as text turns)
    earlier: EarlierTurn | None = None

    def prompt_tokens_for(self, k: int) -> int:
        """Token count of the prompt with the first ``k`` slots (laid out as this prompt's layout)."""
        if self.candidate_ids is not None:
            return len(self.candidate_ids[k])
        return (self.scaffold_len + self.history_tokens + sum(self.chunk_token_counts[:k])
                + self.question_tokens + self.framing_tokens)

    def ids_for(self, k: int) -> list[int]:
        """Token ids of the prompt with the first ``k`` slots: ``len == prompt_tokens_for(k)``.

        In rank order each segment is encoded on its own (module docstring), so this is exactly
        ``build(..chunks[:k]..).ids``: the leading ``k`` chunk segments, then the question and the
        framing after it. In another layout, the ids :meth:`PromptBuilder.candidates` built.
        """
        if self.candidate_ids is not None:
            return list(self.candidate_ids[k])
        head = self.scaffold_len + self.history_tokens + sum(self.chunk_token_counts[:k])
        tail = self.question_tokens + self.framing_tokens
        return list(self.ids[:head]) + list(self.ids[len(self.ids) - tail:])

    def planned_chunk_tokens(self) -> list[int]:
        """What each further slot adds to the prompt, ``prompt_tokens_for(k) - prompt_tokens_for(k-1)``
        for ``k = 1..K``: the planner's ``chunk_tokens`` (in rank order, ``chunk_token_counts``)."""
        if self.candidate_ids is None:
            return list(self.chunk_token_counts)
        n = [len(ids) for ids in self.candidate_ids]
        return [b - a for a, b in zip(n, n[1:], strict=False)]


class PromptBuilder:
    """Builds :class:`Prompt` s for one tokenizer and chat template.

    Args:
        tokenizer: the generator's :class:`TextTokenizer`.
        chat_template: the template in force; None: the tokenizer's own
            (:func:`generation.chat_template.resolve_chat_template`).

    Raises:
        InvalidConfig: no template (code ``no_chat_template``); a template that does not
            echo the message contents; a template whose prompt does not end by opening the
            assistant's turn (code ``chat_template_no_assistant_turn``,
            :func:`app.prompting.framing.check_assistant_turn`); a marker that is not one special token of the
            tokenizer (code ``chat_template_mismatch``).
    """

    def __init__(self, tokenizer: TextTokenizer, chat_template: ChatTemplate | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = chat_template or resolve_chat_template(tokenizer, None)
        hf = getattr(tokenizer, "hf", None)
        specials = {}
        if hf is not None:
            for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
                value = getattr(hf, attr, None)
                if isinstance(value, str):
                    specials[attr] = value
        self.turns: TurnFraming | None = None
        if self.template.source is None:
            self.framing = plain_framing(tokenizer)
        else:
            self.framing = derive_framing(self.template.source, specials)
            check_assistant_turn(self.template.source, specials)
            self.turns = derive_turn_framing(self.template.source, specials, self.framing.system_supported)
        nl = tokenizer.encode("\n")
        # SentencePiece adds a prefix space at the start of every encode; encode after a newline instead.
        self._nl_ids = nl if tokenizer.encode("\nx")[len(nl):] != tokenizer.encode("x") else []
        f = self.framing
        controls = [f.system_prefix, f.system_to_user, f.user_suffix]
        if self.turns is not None:
            controls += [self.turns.user_to_assistant, self.turns.assistant_to_user]
        self._control_ids = {s: self._encode_control(s) for s in controls}
        self._check_markers()
        self.end_of_turn_ids = self._end_of_turn()
        self._scaffolds: dict[str, list[int]] = {}

    @property
    def turn_close_ids(self) -> list[int] | None:
        """The ids a follow-up places right after an earlier answer's output ids (the
        template's end of the assistant turn and the next user header, as
        :meth:`continuation_ids` lays them out); None when the template cannot render earlier
        assistant turns. The local engine warms them with a finished answer."""
        return list(self._control_ids[self.turns.assistant_to_user]) if self.turns is not None else None

    @classmethod
    def for_tokenizer(cls, tokenizer: TextTokenizer, chat_template: str | None = None) -> PromptBuilder:
        """Builder for ``tokenizer`` with the template the ``chat_template`` setting selects.

        ``chat_template`` None: the tokenizer's own template (refused when it has none).
        """
        return cls(tokenizer, resolve_chat_template(tokenizer, chat_template))

    @classmethod
    def for_generator(cls, generator: Any, chat_template: str | None = None) -> PromptBuilder:
        """:meth:`for_tokenizer` of ``generator.tokenizer``."""
        return cls.for_tokenizer(generator.tokenizer, chat_template)

    def _check_markers(self) -> None:
        """Refuse framing markers that the tokenizer would read as plain text.

        Raises:
            InvalidConfig: code ``chat_template_mismatch``, naming the marker.
        """
        for text in self._control_ids:
            for marker in find_markers(text):
                control = self._encode_control(marker)
                if len(control) != 1 or self.tokenizer.encode(marker) == control:
                    raise InvalidConfig(
                        f"the chat template ({self.template.origin}: {self.template.name}) uses "
                        f"{marker!r}, which is not a special token of this tokenizer: the model would "
                        "read it as plain text. Use the model's own template or a template of its "
                        "family (RAGBUDGET_CHAT_TEMPLATE)", code="chat_template_mismatch",
                        marker=marker, template=self.template.name)

    def _end_of_turn(self) -> list[int]:
        """The special token that starts the framing after the user's text, if any (ends the answer)."""
        ctrl = self._control_ids[self.framing.user_suffix]
        plain = self.tokenizer.encode(self.framing.user_suffix)
        if ctrl and (not plain or ctrl[0] != plain[0]):
            return [ctrl[0]]
        return []

    def describe(self) -> dict[str, Any]:
        """The template in force and the end-of-turn ids (receipts, CLI)."""
        return {**self.template.describe(), "end_of_turn_ids": list(self.end_of_turn_ids)}

    # --- encoding ---------------------------------------------------------------------
    def _encode_control(self, text: str) -> list[int]:
        """Template text, special-token strings recognised as control tokens."""
        if not text:
            return []
        control = getattr(self.tokenizer, "encode_control", None)
        if callable(control):
            return list(control(text))
        hf = getattr(self.tokenizer, "hf", None)
        if hf is not None:
            return list(hf(text, add_special_tokens=False, split_special_tokens=False)["input_ids"])
        return list(self.tokenizer.encode(text))

    def encode_plain(self, text: str) -> list[int]:
        """Content text (scaffold, chunk, question) with special-token strings as plain text."""
        if not text:
            return []
        if self._nl_ids:
            ids = self.tokenizer.encode("\n" + text)
            if ids[:len(self._nl_ids)] == self._nl_ids:
                return ids[len(self._nl_ids):]
        return self.tokenizer.encode(text)

    # --- segments -----------------------------------------------------------------------
    @staticmethod
    def chunk_segment(rank: int, chunk: PromptChunk, after_text: bool = False) -> str:
        """The labelled text of the chunk at 1-based ``rank``.

        The blank line between parts opens the next segment instead of closing the
        previous one: byte-level BPE pre-tokenisers split ``"\\n\\n["`` differently
        from a trailing ``"\\n\\n"``, so this way the ids match what the model's
        own chat template would produce for the same text. A slot with copies names them:
        ``[n] (doc a v1; also doc b v1, doc c v2)``. ``after_text``: the
        user turn already holds text (client instructions, an earlier user
        message), so the first chunk opens with a blank line too.
        """
        sep = "\n\n" if rank > 1 or after_text else ""
        also = "".join(f"{', ' if i else '; also '}doc {d} v{v}" for i, (d, v) in enumerate(chunk.also))
        return f"{sep}[{rank}] (doc {chunk.document_id} v{chunk.version}{also})\n{chunk.text}"

    @staticmethod
    def question_segment(question: str) -> str:
        """The question, after a blank line (the same for every k, so its count is constant)."""
        return f"\n\nQuestion: {question}"

    def scaffold_ids(self, scaffold_text: str) -> list[int]:
        """Ids of the scaffold: system header + text + system end + user header (cached per text)."""
        ids = self._scaffolds.get(scaffold_text)
        if ids is None:
            f = self.framing
            if f.system_supported:
                ids = (self._control_ids[f.system_prefix] + self.encode_plain(scaffold_text)
                       + self._control_ids[f.system_to_user])
            else:
                ids = self._control_ids[f.system_prefix] + self.encode_plain(scaffold_text + f.system_to_user)
            self._scaffolds[scaffold_text] = ids
        return list(ids)

    def history_segments(self, history: list[Turn]) -> tuple[list[int], list[dict[str, str]], str]:
        """Ids of the conversation between scaffold and chunks
        (:func:`app.prompting.conversation.prompt_turns`).

        Returns ``(ids, turns, open_text)``: ``turns`` are the closed chat turns
        (``{"role", "content"}``) for backends that take messages; ``open_text`` is
        the text the last user turn already holds before the chunks ("" when none).

        Raises:
            InvalidInput (``unsupported_role``): a role other than system, developer,
                user or assistant.
            InvalidConfig: there are assistant turns and the chat template cannot render them.
        """
        merged = prompt_turns(history)
        if any(t.role == "assistant" for t in merged) and self.turns is None:
            raise InvalidConfig("the model's chat template cannot render earlier assistant turns")
        ids: list[int] = []
        closed: list[dict[str, str]] = []
        for i, turn in enumerate(merged):
            ids += self.encode_plain(turn.content)
            if i + 1 < len(merged) or turn.role == "assistant":
                assert self.turns is not None
                ids += self._control_ids[self.turns.assistant_to_user if turn.role == "assistant"
                                         else self.turns.user_to_assistant]
                closed.append(turn.to_dict())
        open_text = merged[-1].content if merged and merged[-1].role == "user" else ""
        return ids, closed, open_text

    def continuation_ids(self, scaffold: list[int], earlier: EarlierTurn) -> list[int]:
        """The ids between the scaffold and the new chunks of a follow-up that continues
        ``earlier``: ``earlier.prompt_ids[len(scaffold):] + earlier.answer_ids``, then the
        template's end of the assistant turn and the new user header (``assistant_to_user``;
        when the answer's ids already end with its first token, the end-of-turn token the model
        generated, the rest of it). So ``scaffold + continuation_ids`` starts with exactly
        ``earlier.prompt_ids + earlier.answer_ids``.

        Raises:
            InvalidConfig: the chat template cannot render earlier assistant turns.
            ValueError: ``earlier.prompt_ids`` does not start with ``scaffold``.
        """
        if self.turns is None:
            raise InvalidConfig("the model's chat template cannot render earlier assistant turns")
        if list(earlier.prompt_ids[:len(scaffold)]) != list(scaffold):
            raise ValueError(f"the earlier turn {earlier.receipt_id} does not start with this scaffold")
        close = self._control_ids[self.turns.assistant_to_user]
        answer = list(earlier.answer_ids)
        if answer and close and answer[-1] == close[0]:
            close = close[1:]
        return list(earlier.prompt_ids[len(scaffold):]) + answer + list(close)

    def build(self, scaffold_text: str, chunks: list[PromptChunk], question: str,
              history: list[Turn] | None = None, *, order: list[int] | None = None,
              layout: str = "rank", earlier: EarlierTurn | None = None,
              _memo: dict[str, list[int]] | None = None) -> Prompt:
        """Lay out ``[scaffold][conversation][chunks][question][assistant header]`` as ids.

        ``history``: the messages before the question (system/developer messages and
        earlier user/assistant turns, in order), laid out as the module docstring says.
        ``earlier``: the earlier turn ``history`` ends with, as it was shown and generated
        (``app.answering.followup``); then the conversation's ids are
        :meth:`continuation_ids` instead of the history as text turns: the prompt is
        ``[earlier prompt][earlier answer][end of turn, user header][chunks][question][assistant
        header]`` (``messages``, for backends that take them, stay the text turns).
        ``order``: the chunks in the order the prompt shows them, as 1-based indices into
        ``chunks`` (a permutation; default ``1..len(chunks)``, rank order), numbered ``[1]``,
        ``[2]``, ... in that order; ``layout`` names the rule that chose it (recorded, see
        :mod:`app.prompting.layout`).

        Raises:
            EmptyContent: the question is blank.
            ValueError: ``order`` is not a permutation of ``1..len(chunks)``.
            InvalidInput, InvalidConfig: see :meth:`history_segments`.
        """
        if not question.strip():
            raise EmptyContent("the question is empty")
        shown = list(order) if order is not None else list(range(1, len(chunks) + 1))
        if sorted(shown) != list(range(1, len(chunks) + 1)):
            raise ValueError(f"order {shown} is not a permutation of 1..{len(chunks)}")
        encode = self.encode_plain if _memo is None else (
            lambda text: _memo[text] if text in _memo else _memo.setdefault(text, self.encode_plain(text)))
        scaffold = self.scaffold_ids(scaffold_text)
        ids = list(scaffold)
        history_ids, turns, open_text = self.history_segments(list(history or []))
        if earlier is not None:
            history_ids, open_text = self.continuation_ids(scaffold, earlier), ""
        ids += history_ids
        counts: list[int] = []
        segments: list[str] = [open_text]
        for rank, index in enumerate(shown, start=1):
            seg = self.chunk_segment(rank, chunks[index - 1], after_text=bool(open_text))
            seg_ids = encode(seg)
            counts.append(len(seg_ids))
            segments.append(seg)
            ids += seg_ids
        q_text = self.question_segment(question)
        q_ids = encode(q_text)
        segments.append(q_text)
        ids += q_ids
        tail = self._control_ids[self.framing.user_suffix]
        ids += tail
        user = "".join(segments)
        turns.append({"role": "user", "content": user})
        if self.framing.system_supported:
            messages = [{"role": "system", "content": scaffold_text}, *turns]
        else:
            first = turns[0]
            messages = [{"role": first["role"],
                         "content": scaffold_text + self.framing.system_to_user + first["content"]},
                        *turns[1:]]
        return Prompt(ids=ids, scaffold_ids=scaffold, scaffold_len=len(scaffold), prompt_tokens=len(ids),
                      chunk_token_counts=counts, question_tokens=len(q_ids), framing_tokens=len(tail),
                      text=self.tokenizer.decode(ids), prompt_hash=sha256_ints(ids),
                      scaffold_hash=sha256_text(normalize_text(scaffold_text)), messages=messages,
                      history_tokens=len(history_ids), order=shown, layout=layout, earlier=earlier)

    def candidates(self, scaffold_text: str, chunks: list[PromptChunk], question: str,
                   history: list[Turn] | None = None, *, layout: str = "rank",
                   earlier: EarlierTurn | None = None) -> Prompt:
        """The prompt with every slot of ``chunks`` (rank order, :meth:`build`) and, for a layout
        other than rank order, the ids of each candidate prompt ``k = 0..K`` as that layout shows
        its first ``k`` slots (``Prompt.candidate_ids``: what the planner counts and looks up).

        Segment encodings are shared between the candidates (each chunk's labelled text at a
        given position is encoded once). ``earlier``: as :meth:`build`, for every candidate.

        Raises:
            as :meth:`build`; ValueError: an unknown ``layout`` (:func:`app.prompting.layout.layout_order`).
        """
        from app.prompting.layout import layout_order

        full = self.build(scaffold_text, chunks, question, history, earlier=earlier)
        if layout == "rank":
            return full
        memo: dict[str, list[int]] = {}
        full.candidate_ids = [self.build(scaffold_text, chunks[:k], question, history,
                                         order=layout_order(chunks[:k], layout), layout=layout,
                                         earlier=earlier, _memo=memo).ids
                              for k in range(len(chunks) + 1)]
        full.layout = layout
        return full

    def count_tokens_for_plan(self, scaffold_text: str, chunks: list[PromptChunk],
                              question: str, history: list[Turn] | None = None) -> list[int]:
        """``[prompt_tokens with k chunks for k in 0..len(chunks)]``, equal to ``len(build(..k..).ids)``."""
        full = self.build(scaffold_text, chunks, question, history)
        return [full.prompt_tokens_for(k) for k in range(len(chunks) + 1)]
