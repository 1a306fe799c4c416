"""Stop sequences on the decoded text stream, in one place for every backend.

OpenAI's ``stop`` semantics: generation ends at the first occurrence of any
stop string in the decoded answer text; the stop string and everything after it
are not returned; ``finish_reason`` is ``"stop"``. Detection runs on the text
deltas a backend streams (:class:`generation.base.TokenEvent.text`), never on
token ids, so a stop string split across tokens (``"\\n"`` + ``"\\n"``) or
inside one token (``"end."``) is found the same way for the local model, a
batching scheduler or a remote server.

To never stream part of a stop string before knowing it is one, the matcher
holds back the longest tail of the unreleased text that is a proper prefix of
some stop string (nothing at all for single-character stops), the method of
vLLM's and TGI's stop checkers. The answer pipeline and replay's regeneration
both feed their backend's stream through :class:`StopMatcher`, so a replay
stops exactly where the answer did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from foundation.errors import InvalidInput

#: OpenAI accepts at most 4 stop sequences.
MAX_STOP_SEQUENCES = 4
#: Longest stop string accepted (characters).
MAX_STOP_CHARS = 256


def normalize_stop(stop: str | Sequence[str] | None) -> list[str]:
    """``stop`` as a list: ``None`` -> ``[]``, a string -> ``[string]``, a list as given.

    Raises:
        InvalidInput (``invalid_stop``, ``details.field == "stop"``): more than
            :data:`MAX_STOP_SEQUENCES` strings, an empty string, a string over
            :data:`MAX_STOP_CHARS` characters, or a non-string item.
    """
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > MAX_STOP_SEQUENCES:
        raise InvalidInput(f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(items)}",
                           code="invalid_stop", field="stop")
    for item in items:
        if not isinstance(item, str):
            raise InvalidInput("every stop sequence must be a string", code="invalid_stop", field="stop")
        if not item:
            raise InvalidInput("a stop sequence must not be empty", code="invalid_stop", field="stop")
        if len(item) > MAX_STOP_CHARS:
            raise InvalidInput(f"a stop sequence may have at most {MAX_STOP_CHARS} characters",
                               code="invalid_stop", field="stop")
    return items


@dataclass
class StopMatcher:
    """Cuts a stream of text deltas at the first occurrence of any stop string.

    Feed each delta with :meth:`feed`; it returns the text that may be released
    now and whether a stop string was found. When the stream ends without a
    stop, :meth:`flush` returns the text still held back. With no stop strings
    every delta is released unchanged.

    Attributes:
        stops: the stop strings (see :func:`normalize_stop`).
        matched: the stop string found, or ``None``.
        released: all text released so far (the answer as returned).
    """

    stops: list[str]
    matched: str | None = None
    released: str = ""
    _pending: str = field(default="", repr=False)

    @property
    def stopped(self) -> bool:
        """True once a stop string was found (``matched`` is set)."""
        return self.matched is not None

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add ``delta``; return ``(text to release now, stopped)``.

        After a stop was found every further call returns ``("", True)``.
        """
        if self.matched is not None:
            return "", True
        if not self.stops:
            self.released += delta
            return delta, False
        pending = self._pending + delta
        # Earliest start wins; among stops starting at the same place, the longest.
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            i = pending.find(s)
            if i >= 0 and (best is None or (i, -len(s)) < (best[0], best[1])):
                best = (i, -len(s), s)
        if best is not None:
            out = pending[:best[0]]
            self.matched, self._pending = best[2], ""
            self.released += out
            return out, True
        hold = self._held_back(pending)
        out, self._pending = pending[:len(pending) - hold], pending[len(pending) - hold:]
        self.released += out
        return out, False

    def flush(self) -> str:
        """The held-back text, released at the end of a stream that did not stop."""
        if self.matched is not None:
            return ""
        out, self._pending = self._pending, ""
        self.released += out
        return out

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return hold

