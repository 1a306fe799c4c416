"""Chunking: token windows over normalised text, with exact character offsets.

Algorithm (``ragbudget.chunker/1``):

1. The text is tokenised once with the generator's tokenizer; the token start
   offsets give a cheap estimate of the token count of any span.
2. It is cut into *units*: paragraphs (blank-line separated) split at sentence
   ends and line breaks. A unit longer than the window is split at whitespace
   into words, and a word longer than the window (base64, URLs, CJK without
   spaces) is hard-split at token starts. Every unit is trimmed of whitespace,
   and units with nothing visible are dropped. Every cut lies on an extended
   grapheme-cluster boundary (Unicode UAX #29, via the ``regex`` module's
   ``\\X``), so no character, combining sequence or emoji ZWJ sequence is cut.
3. Units are packed greedily into windows of at most ``chunk_tokens``. The cut
   goes after the strongest boundary (end of text > paragraph > sentence >
   line > word > hard split) that leaves the window at least half full.
4. Each window is then counted *exactly*: ``len(tokenizer.encode(chunk))`` must
   be ``<= chunk_tokens`` and, when ``embed_token_count`` is given, the
   embedder's word-piece count (with ``[CLS]``/``[SEP]``) ``<= max_embed_tokens``;
   otherwise the window is shrunk (and a single unit is split further).
   ``ChunkSpan.n_tokens`` is that exact count of the chunk on its own.
5. The next window starts at the earliest unit such that the repeated tail is
   at most ``overlap_tokens`` (estimated), and always ends beyond the previous
   one, so starts and ends are strictly increasing.

Special-token strings in the text are ordinary text: the tokenizer protocol
encodes them as characters (``split_special_tokens=True``).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import regex

from foundation.errors import InvalidConfig
from foundation.hashing import canonical_json, sha256_json, sha256_text
from retrieval.tokens import TextTokenizer

CHUNKER_NAME = "ragbudget.chunker/1"

# Boundary strengths (the boundary *after* a unit).
HARD, WORD, LINE, SENTENCE, PARAGRAPH, END = 0, 1, 2, 3, 4, 5

_PARAGRAPH_SEP = regex.compile(r"\n[^\S\n]*\n\s*")
_SENTENCE_END = regex.compile(
    r"[.!?\u2026][\"'\u201d\u2019)\]]*(?=\s)"  # Latin: a terminator followed by whitespace
    r"|[\u3002\uff01\uff1f][\u300d\u300f\uff09\"\u201d]*"  # CJK: 。！？ need no space
)
_NEWLINE = regex.compile(r"\n")
_WORD = regex.compile(r"\S+")
_VISIBLE = regex.compile(r"[^\s\p{Cc}\p{Cf}\p{Zs}\p{Zl}\p{Zp}]")
_CLUSTER_RISK = regex.compile(
    r"[\r\p{Grapheme_Cluster_Break=Extend}\p{Grapheme_Cluster_Break=ZWJ}"
    r"\p{Grapheme_Cluster_Break=SpacingMark}\p{Grapheme_Cluster_Break=Regional_Indicator}"
    r"\p{Grapheme_Cluster_Break=Prepend}\p{Grapheme_Cluster_Break=L}\p{Grapheme_Cluster_Break=V}"
    r"\p{Grapheme_Cluster_Break=T}\p{Grapheme_Cluster_Break=LV}\p{Grapheme_Cluster_Break=LVT}]"
)


@dataclass(frozen=True)
class ChunkerConfig:
    """Window size and overlap in generator tokens; the embedder's word-piece limit.

    Raises:
        InvalidConfig: ``chunk_tokens < 1``, ``overlap_tokens < 0``,
            ``overlap_tokens >= chunk_tokens`` or ``max_embed_tokens < 3``.
    """

    chunk_tokens: int
    overlap_tokens: int
    max_embed_tokens: int = 256  # all-MiniLM-L6-v2 max_seq_length (sentence-transformers config)

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise InvalidConfig(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.overlap_tokens < 0:
            raise InvalidConfig(f"overlap_tokens must be >= 0, got {self.overlap_tokens}")
        if self.overlap_tokens >= self.chunk_tokens:
            raise InvalidConfig(f"overlap_tokens ({self.overlap_tokens}) must be smaller than "
                                f"chunk_tokens ({self.chunk_tokens})")
        if self.max_embed_tokens < 3:
            raise InvalidConfig(f"max_embed_tokens must be >= 3, got {self.max_embed_tokens}")


def chunker_id(config: ChunkerConfig, tokenizer_id: str) -> str:
    """``sha256:`` over the chunker's name, its config and the generator tokenizer's id."""
    return sha256_json({"chunker": CHUNKER_NAME, "chunk_tokens": config.chunk_tokens,
                        "overlap_tokens": config.overlap_tokens,
                        "max_embed_tokens": config.max_embed_tokens, "tokenizer_id": tokenizer_id})


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk: ``text == source[start_char:end_char]``; ``n_tokens`` counted exactly."""

    ordinal: int
    start_char: int
    end_char: int
    text: str
    n_tokens: int
    chunk_hash: str


def chunk_id(document_id: str, version: int, ordinal: int) -> int:
    """Deterministic chunk id: the first 8 bytes of ``sha256(canonical_json([doc, version, ordinal]))``
    as a big-endian int, masked to 63 bits (a positive FAISS ``int64``); never 0."""
    digest = hashlib.sha256(canonical_json([document_id, int(version), int(ordinal)])).digest()
    return (int.from_bytes(digest[:8], "big") & (2**63 - 1)) or 1


def wordpiece_counter(model_dir: str | Path) -> Callable[[str], int]:
    """A word-piece counter for ``embed_token_count``: the HF tokenizer in ``model_dir``,
    counting ``[CLS]`` and ``[SEP]``, never truncating."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"])

    return count


def has_visible(text: str, start: int = 0, end: int | None = None) -> bool:
    """True when ``text[start:end]`` has a character that is not whitespace, control or format."""
    return _VISIBLE.search(text, start, len(text) if end is None else end) is not None


class _Bounds:
    """Extended grapheme-cluster boundaries of a text (all positions when no cluster can span)."""

    def __init__(self, text: str) -> None:
        self.n = len(text)
        self.flags: bytearray | None = None
        if _CLUSTER_RISK.search(text) is not None:
            flags = bytearray(self.n + 1)
            flags[0] = 1
            for m in regex.finditer(r"\X", text):
                flags[m.end()] = 1
            self.flags = flags

    def ok(self, pos: int) -> bool:
        return self.flags is None or bool(self.flags[pos])

    def back(self, pos: int, floor: int) -> int:
        """Largest boundary in ``(floor, pos]``, or ``floor`` if none."""
        while pos > floor and not self.ok(pos):
            pos -= 1
        return pos

    def fwd(self, pos: int) -> int:
        """Smallest boundary ``>= pos``."""
        while pos < self.n and not self.ok(pos):
            pos += 1
        return pos


@dataclass
class _Unit:
    start: int
    end: int
    strength: int


class _Chunker:
    def __init__(self, text: str, tokenizer: TextTokenizer, config: ChunkerConfig,
                 embed_token_count: Callable[[str], int] | None) -> None:
        self.text = text
        self.tok = tokenizer
        self.size = config.chunk_tokens
        self.overlap = config.overlap_tokens
        self.max_embed = config.max_embed_tokens
        self.embed = embed_token_count
        _, offsets = tokenizer.encode_with_offsets(text)
        self.starts = sorted(o[0] for o in offsets)
        self.bounds = _Bounds(text)

    # --- counting -------------------------------------------------------------------
    def est(self, a: int, b: int) -> int:
        """Tokens of the full-text encoding that start in ``[a, b)``."""
        return bisect_left(self.starts, b) - bisect_left(self.starts, a)

    def exact(self, a: int, b: int) -> int | None:
        """Exact generator-token count of ``text[a:b]`` if it fits both limits, else None."""
        piece = self.text[a:b]
        n = len(self.tok.encode(piece))
        if n > self.size:
            return None
        if self.embed is not None and self.embed(piece) > self.max_embed:
            return None
        return n

    # --- units ------------------------------------------------------------------------
    def _trimmed(self, a: int, b: int) -> tuple[int, int] | None:
        t = self.text
        while a < b and t[a].isspace():
            a += 1
        while b > a and t[b - 1].isspace():
            b -= 1
        a, b = self.bounds.fwd(a), self.bounds.fwd(b)
        if a >= b or not has_visible(t, a, b):
            return None
        return a, b

    def units(self) -> list[_Unit]:
        t = self.text
        out: list[_Unit] = []
        para_start = 0
        seps = [(m.start(), m.end()) for m in _PARAGRAPH_SEP.finditer(t)] + [(len(t), len(t))]
        for sep_start, sep_end in seps:
            cuts: dict[int, int] = {}
            for m in _SENTENCE_END.finditer(t, para_start, sep_start):
                cuts[m.end()] = SENTENCE
            for m in _NEWLINE.finditer(t, para_start, sep_start):
                cuts[m.start()] = max(cuts.get(m.start(), 0), LINE)
            prev = para_start
            points = sorted(p for p in cuts if para_start < p < sep_start)
            for p in [*points, sep_start]:
                strength = cuts.get(p, PARAGRAPH) if p != sep_start else PARAGRAPH
                span = self._trimmed(prev, p)
                prev = p
                if span is not None:
                    self._add(out, span[0], span[1], strength)
            para_start = sep_end
        if out:
            out[-1].strength = END
        return out

    def _add(self, out: list[_Unit], a: int, b: int, strength: int) -> None:
        if self.est(a, b) <= self.size:
            out.append(_Unit(a, b, strength))
            return
        words = [(m.start(), m.end()) for m in _WORD.finditer(self.text, a, b)]
        if len(words) > 1:
            for idx, (wa, wb) in enumerate(words):
                span = self._trimmed(wa, wb)
                if span is not None:
                    self._add(out, span[0], span[1], strength if idx == len(words) - 1 else WORD)
            return
        pieces = self._hard_cuts(a, b)
        for idx, (pa, pb) in enumerate(pieces):
            span = self._trimmed(pa, pb)
            if span is not None:
                out.append(_Unit(span[0], span[1], strength if idx == len(pieces) - 1 else HARD))

    def _hard_cuts(self, a: int, b: int) -> list[tuple[int, int]]:
        """Split ``[a, b)`` at token starts into pieces of at most ``size`` estimated tokens."""
        pieces, cur = [], a
        while cur < b:
            first = bisect_left(self.starts, cur)
            idx = first + self.size
            end = b if idx >= len(self.starts) or self.starts[idx] >= b else self.starts[idx]
            end = self.bounds.back(end, cur)
            if end <= cur:
                end = min(b, self.bounds.fwd(cur + 1))
            pieces.append((cur, end))
            cur = end
        return pieces

    def split_exact(self, unit: _Unit) -> list[_Unit]:
        """Split one unit that does not fit exactly into maximal pieces that do."""
        out, cur, b = [], unit.start, unit.end
        while cur < b:
            cands = sorted({self.bounds.back(p, cur) for p in self.starts[bisect_left(self.starts, cur + 1):
                                                                         bisect_left(self.starts, b)]}
                           | {b})
            cands = [p for p in cands if p > cur]
            lo, hi, best = 0, len(cands) - 1, -1
            while lo <= hi:
                mid = (lo + hi) // 2
                if self.exact(cur, cands[mid]) is not None:
                    best, lo = mid, mid + 1
                else:
                    hi = mid - 1
            # Last resort (one grapheme cluster over the limit, e.g. hundreds of combining
            # marks): cut at code points so the limits still hold.
            end = cands[best] if best >= 0 else self._codepoint_end(cur, b)
            span = self._trimmed(cur, end) if best >= 0 else (cur, end)
            if span is not None:
                out.append(_Unit(span[0], span[1], HARD))
            cur = end
            while cur < b and self.text[cur].isspace():
                cur += 1
        if out:
            out[-1].strength = unit.strength
        return out

    def _codepoint_end(self, cur: int, b: int) -> int:
        lo, hi, best = cur + 1, b, cur + 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.exact(cur, mid) is not None:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best

    # --- packing -------------------------------------------------------------------------
    def choose(self, units: list[_Unit], i: int, j: int) -> int:
        min_fill = self.size // 2
        best, key = j, (-1, -1)
        for k in range(i, j + 1):
            if k == j or self.est(units[i].start, units[k].end) >= min_fill:
                cand = (units[k].strength, k)
                if cand > key:
                    best, key = k, cand
        return best

    def run(self) -> list[ChunkSpan]:
        units = self.units()
        spans: list[ChunkSpan] = []
        i, must_pass = 0, 0  # the next chunk must end at or after unit ``must_pass``
        while i < len(units):
            j = i
            while j + 1 < len(units) and self.est(units[i].start, units[j + 1].end) <= self.size:
                j += 1
            k = self.choose(units, i, j)
            n = self.exact(units[i].start, units[k].end)
            if n is None:
                lo, hi, best = i, k - 1, None
                while lo <= hi:
                    mid = (lo + hi) // 2
                    r = self.exact(units[i].start, units[mid].end)
                    if r is not None:
                        best, lo = (mid, r), mid + 1
                    else:
                        hi = mid - 1
                if best is None:
                    pieces = self.split_exact(units[i])
                    units[i:i + 1] = pieces
                    if must_pass > i:
                        must_pass += len(pieces) - 1
                    continue
                k, n = best
                k2 = self.choose(units, i, k)
                if k2 != k and (r2 := self.exact(units[i].start, units[k2].end)) is not None:
                    k, n = k2, r2
            if k < must_pass:  # the overlap left no room for new text: drop it
                i = must_pass
                continue
            a, b = units[i].start, units[k].end
            piece = self.text[a:b]
            spans.append(ChunkSpan(len(spans), a, b, piece, n, sha256_text(piece)))
            if k == len(units) - 1:
                break
            must_pass = k + 1
            m = k
            if self.overlap > 0:
                while m > i and self.est(units[m].start, units[k].end) <= self.overlap:
                    m -= 1
            m += 1
            while m <= k and self.est(units[m].start, units[k + 1].end) > self.size:
                m += 1
            i = m
        return spans


def chunk_text(text: str, tokenizer: TextTokenizer, config: ChunkerConfig,
               embed_token_count: Callable[[str], int] | None = None) -> list[ChunkSpan]:
    """Cut already-normalised ``text`` into token windows (see the module docstring).

    Returns chunks with ordinals 0..n-1, ``text[c.start_char:c.end_char] == c.text``,
    strictly increasing starts and ends, no empty or invisible-only chunk, every
    chunk ``<= config.chunk_tokens`` generator tokens and, with
    ``embed_token_count``, ``<= config.max_embed_tokens`` word-pieces. An empty
    or invisible-only text gives ``[]``. Never raises on special-token strings.
    """
    if not has_visible(text):
        return []
    return _Chunker(text, tokenizer, config, embed_token_count).run()
