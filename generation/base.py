"""The generator contract: parameters, streamed token events, per-answer statistics, and the protocol.

Two backends implement :class:`Generator`: ``generation.local`` (a
transformers causal LM with a scaffold prefix KV cache) and
``generation.remote`` (an OpenAI-compatible streaming server such as vLLM
or SGLang). The answer pipeline and the latency calibration code only see this
module.

What only some generators can do is declared here once, as small runtime-checkable protocols,
and asked with ``isinstance`` (never by probing attributes by name): a generator running on an
engine of its own (:class:`SupportsEngine`, the local one) whose engine looks up its prefix
cache (:class:`SupportsPrefixLookup`), shows its running batch (:class:`SupportsBatchSnapshot`,
with :class:`SupportsStepBudget`) and keeps its timed steps (:class:`SupportsRecentSteps`); a
generator that chunks its prefill (:class:`SupportsPrefillChunk`), runs several answers at
once (:class:`SupportsMaxRunning`) or keeps a block prefix cache (:class:`SupportsPrefixCache`).
A remote backend has none of the engine's; the planner then prices what it can without them.

Timing conventions (docs/architecture.md, "Contracts"): every time
stamp is ``time.perf_counter()`` in seconds; durations are converted to ms once
and carry ``_ms`` in their names. TTFT and TPOT follow vLLM's benchmark
definitions (``benchmarks/backend_request_func.py`` / ``benchmark_serving.py``):
the first token is the first one with non-empty text, and
``tpot = (latency - ttft) / (output_tokens - 1)``.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Generator as PyGenerator
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from foundation.errors import InvalidInput
from foundation.hashing import MAX_SAFE_INTEGER
from retrieval.tokens import TextTokenizer

if TYPE_CHECKING:
    from generation.engine.messages import BatchSnapshot, StepRecord

#: Largest accepted seed: 2**53 - 1, so a seed is a plain JSON number every reader holds exactly.
MAX_SEED = MAX_SAFE_INTEGER
FinishReason = Literal["stop", "length", "cancelled", "error"]
FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "cancelled", "error"})

@dataclass
class GenParams:
    """Decoding parameters.

    ``temperature == 0`` means greedy decoding (deterministic; ``top_p`` and
    ``seed`` are ignored). Sampling (``temperature > 0``) always runs with a
    seed: :meth:`resolved` draws one when none was given, and the backends
    record the resolved parameters in :attr:`GenerationStats.params`.

    ``ignore_eos`` and ``min_tokens`` have vLLM's meanings (``SamplingParams``):
    with ``ignore_eos`` the answer goes on past end-of-text and stop token ids until
    ``max_new_tokens`` (those tokens are output like any other); ``min_tokens``
    masks the end-of-text and stop token ids out (logit ``-inf``) until that many
    tokens were generated. :meth:`validate` holds the accepted ranges.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        """True when ``temperature <= 0``: argmax decoding; ``top_p`` and ``seed`` do not apply."""
        return self.temperature <= 0.0

    def validate(self) -> GenParams:
        """Check every field against its accepted range; return ``self``.

        The ranges are vLLM's (``SamplingParams._verify_args``): ``max_new_tokens >= 1``,
        ``temperature`` finite in ``[0, 2]``, ``top_p`` in ``(0, 1]``, ``0 <= min_tokens <=
        max_new_tokens``; plus ``0 <= seed <= MAX_SEED`` (a JSON-safe integer) and plain
        ``bool``/``int``/``float`` types (no ``True`` for 1). Every value in these ranges
        samples without error (``generation.local`` computes safely for any of them).

        Raises:
            InvalidInput: code ``invalid_sampling_parameter``, ``details["param"]`` naming the
                field and ``details["value"]`` its ``repr``.
        """
        def bad(name: str, why: str) -> InvalidInput:
            value = getattr(self, name)
            return InvalidInput(f"{name} {why}, got {value!r}", code="invalid_sampling_parameter",
                                param=name, value=repr(value))

        for name in ("max_new_tokens", "min_tokens"):
            if type(getattr(self, name)) is not int:
                raise bad(name, "must be an integer")
        if self.seed is not None and type(self.seed) is not int:
            raise bad("seed", "must be an integer or null")
        if type(self.ignore_eos) is not bool:
            raise bad("ignore_eos", "must be true or false")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        if self.max_new_tokens < 1:
            raise bad("max_new_tokens", "must be at least 1")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", "must be in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise bad("seed", "must be in [0, 2**53 - 1]")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be at least 0")
        if self.min_tokens > self.max_new_tokens:
            raise InvalidInput(f"min_tokens must be at most max_new_tokens={self.max_new_tokens}, "
                               f"got {self.min_tokens}", code="invalid_sampling_parameter",
                               param="min_tokens", value=repr(self.min_tokens))
        return self

    def resolved(self) -> GenParams:
        """These parameters with a seed drawn (``0 <= seed < 2**31``) when sampling without one."""
        if self.greedy or self.seed is not None:
            return self
        return dataclasses.replace(self, seed=random.SystemRandom().randrange(2**31))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict (for receipts).

        ``ignore_eos`` and ``min_tokens`` appear only when they differ from their defaults,
        so a receipt of an answer that does not use them reads as it did before they existed.
        """
        out = dataclasses.asdict(self)
        for name in _OMITTED_AT_DEFAULT:
            if out[name] == _DEFAULTS[name]:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenParams:
        """The parameters a receipt recorded (:meth:`to_dict`); keys of other layers (``stop``)
        are ignored and fields a receipt lacks take their defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


_OMITTED_AT_DEFAULT = ("ignore_eos", "min_tokens")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenParams)}


@dataclass
class TokenEvent:
    """One generated token (local) or one streamed text chunk (remote).

    Attributes:
        index: 0-based position of the event in the answer.
        token_id: the token id; ``-1`` for a remote chunk (the server sends text,
            not ids; output ids are recounted once at the end with the model's tokenizer).
        text: the text this event adds (may be ``""`` while a multibyte character
            is incomplete; the held-back bytes arrive with a later event).
        t: ``time.perf_counter()`` when the token was available to the caller.
    """

    index: int
    token_id: int
    text: str
    t: float


@dataclass
class GenerationStats:
    """What one :meth:`Generator.stream` call did: :attr:`TokenStream.stats` once the stream ended.

    ``prompt_tokens == cached_tokens + computed_tokens``; ``cached_tokens`` counts
    tokens whose KV came from the prefix cache (0 on a cold scaffold, which is
    computed and stored during the call). ``output_token_ids`` excludes the EOS
    token. ``prefill_ms`` covers the cache copy, the prefill forward and the
    selection of the first token (local), or the time to the first chunk with
    non-empty text (remote, network included). ``usage`` is the remote server's
    own usage report, when it sends one. ``engine_prompt`` (remote, text prompts only)
    is the engine's own split of the prompt when it differs from ``prompt_ids``
    (``prompt_tokens``, ``token_ids_hash``, ``first_difference``; see
    :mod:`generation.remote_text`).
    """

    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    output_token_ids: list[int]  # (output_tokens,), EOS excluded
    finish_reason: FinishReason
    prefill_ms: float
    first_token_t: float | None
    last_token_t: float | None
    first_text_t: float | None = None
    start_t: float | None = None
    params: GenParams | None = None
    error: str | None = None
    usage: dict[str, Any] | None = None
    engine_prompt: dict[str, Any] | None = None
    #: A remote engine reported its cached-token count (``cached_tokens`` is then its figure).
    cache_reported: bool = False

    @property
    def output_tokens(self) -> int:
        """How many tokens were generated (``len(output_token_ids)``)."""
        return len(self.output_token_ids)

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first (vLLM): ``(last - first_text) / (n - 1)``, ms."""
        first = self.first_text_t if self.first_text_t is not None else self.first_token_t
        if first is None or self.last_token_t is None or self.output_tokens < 2:
            return None
        return (self.last_token_t - first) * 1000.0 / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable summary (time stamps are omitted; they are process-local)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.computed_tokens,
            "output_tokens": self.output_tokens,
            "finish_reason": self.finish_reason,
            "prefill_ms": self.prefill_ms,
            "tpot_ms": self.tpot_ms,
            "params": self.params.to_dict() if self.params else None,
            "error": self.error,
            "engine_prompt": self.engine_prompt,
        }


#: What a backend's stream body yields: a token event, or ``None`` once, at the point where the
#: backend has accepted the answer (:class:`TokenStream` runs the body to there when it is made).
StreamBody = PyGenerator[TokenEvent | None, None, None]


class TokenStream(Iterator[TokenEvent]):
    """One answer: iterate it for its :class:`TokenEvent` s, then read :attr:`stats`.

    What :meth:`Generator.stream` returns (as simonw/llm's ``Response``: iterate, then read its
    usage). Made from a backend's ``body``, a generator function called with the stream itself
    (it sets :attr:`stats`, on every path, as it ends): the body runs at once up to its first
    ``yield`` (of ``None``), so what it does before that happens when ``stream()`` is called;
    the local engine queues the answer there (the engine alone owns its waiting line), a remote
    server is sent the request at the first ``next()``. Every later ``None`` is skipped.

    Closing it (:meth:`close`, or leaving a ``with`` block) ends the answer where it is: the
    backend drops it (finish reason ``"cancelled"`` unless it had ended) and :attr:`stats`
    holds what it did. Closing an ended stream does nothing.

    Attributes:
        stats: the :class:`GenerationStats` of this answer once the stream has ended (run out,
            raised, or closed); ``None`` before, and when the backend ended it before starting
            it (a remote stream closed before its first ``next()``).
        accepted_t: ``time.perf_counter()`` when a backend that queues answers itself (the local
            engine) took this one, at the ``stream()`` call; ``None`` for a backend that starts
            the answer at the first ``next()``.
        first_token_deadline_t: ``time.perf_counter()`` seconds by which a remote server must
            send the answer's first token, set by the caller before the first ``next()``
            (``app.fleet.FleetEngine.arm_first_token``); a remote stream that has none by then
            ends with ``BackendError`` code ``first_token_timeout`` (:mod:`generation.remote`).
            ``None``: no such deadline (the read timeout per chunk only). The local engine
            ignores it.

    Raises (from the constructor): what the body raises before its first ``yield``.
    """

    def __init__(self, body: Callable[[TokenStream], StreamBody]) -> None:
        self.stats: GenerationStats | None = None
        self.accepted_t: float | None = None
        self.first_token_deadline_t: float | None = None
        self._body = body(self)
        self._ahead: TokenEvent | None = None
        self._ended = False
        try:
            self._ahead = next(self._body)  # accepted: the body stands at its first yield
        except StopIteration:
            self._ended = True

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> TokenEvent:
        if self._ahead is not None:
            ev, self._ahead = self._ahead, None
            return ev
        if self._ended:
            raise StopIteration
        try:
            while True:
                got = next(self._body)
                if got is not None:
                    return got
        except BaseException:
            self._ended = True
            raise

    def close(self) -> None:
        """End the answer now (see the class docstring); idempotent."""
        self._ended = True
        self._ahead = None
        self._body.close()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@runtime_checkable
class Generator(Protocol):
    """A loaded model that streams tokens for a prompt given as token ids.

    Attributes:
        identity: ``backend, model_id, weights_hash, dtype, device, device_name,
            threads, context_window, software`` (versions), for receipts and profiles.
        tokenizer: the model's :class:`retrieval.tokens.TextTokenizer`.
        context_window: maximum prompt + output tokens.
        eos_token_ids: ids that end an answer.
    """

    identity: dict[str, Any]
    tokenizer: TextTokenizer
    context_window: int
    eos_token_ids: list[int]

    def stream(self, prompt_ids: list[int], *, cached_prefix_ids: list[int] | None,
               params: GenParams, cancel: threading.Event | None = None,
               messages: list[dict[str, str]] | None = None,
               prefill_chunk: int | None = None) -> TokenStream:
        """Start the answer to ``prompt_ids``; its tokens and then its stats come from the
        returned :class:`TokenStream`.

        ``cached_prefix_ids`` (the scaffold) must be a prefix of ``prompt_ids`` to be
        used. ``cancel`` is checked before prefill and between tokens; when set, the
        stream ends within one token with finish_reason ``"cancelled"``.
        ``messages`` is the same prompt as chat messages, used only by a remote
        server that cannot take token ids. ``prefill_chunk`` (tokens) is the prefill chunk
        size of a backend that chunks its prefill (the local engine: it fixes the answer's
        bits, so a replay passes the one a receipt recorded); None: the backend's own; other
        backends ignore it. A backend with its own engine queues the answer before this
        returns (:class:`TokenStream`).

        Raises:
            InvalidInput: empty prompt, prompt longer than the context window, bad parameters.
            BackendError: the model or the remote server failed (from iterating the stream,
                after yielding what arrived).
        """
        ...

    def prefix_cached(self, prefix_ids: list[int]) -> bool:
        """True when the KV cache of exactly ``prefix_ids`` is held (the next stream reuses it)."""
        ...

    def warm_prefix(self, prefix_ids: list[int]) -> float:
        """Compute and keep the KV cache of ``prefix_ids``; return the ms spent (≈0 when already warm)."""
        ...

    def prefill_ms(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Time one prefill of ``prompt_tokens`` tokens of which ``cached_tokens`` come from the cache, ms."""
        ...

    def decode_step_ms(self, context_tokens: int) -> float:
        """Time one decode step with ``context_tokens`` tokens already in the KV cache, ms."""
        ...

    def config_dict(self) -> dict[str, Any]:
        """Model shape for the roofline prior (``num_parameters``, ``num_hidden_layers``, ...)."""
        ...


# --- optional capabilities (see the module docstring) --------------------------------------------

@runtime_checkable
class SupportsEngine(Protocol):
    """A generator that runs its answers on an engine of its own (``engine``: the local
    generator's :class:`generation.engine.core.Engine`); what that engine can tell is asked
    of it with the engine capabilities below."""

    engine: object


@runtime_checkable
class SupportsPrefillChunk(Protocol):
    """A generator that prefills in chunks of ``prefill_chunk`` tokens (the local engine)."""

    prefill_chunk: int


@runtime_checkable
class SupportsMaxRunning(Protocol):
    """A generator that runs up to ``max_running`` answers at once (the local engine's batch, a
    remote server's slots)."""

    max_running: int


@runtime_checkable
class SupportsPrefixCache(Protocol):
    """A generator that keeps a prefix KV cache over token blocks (``prefix_cache``: the local
    generator's :class:`generation.engine.kv_cache.BlockPrefixCache`)."""

    prefix_cache: object


@runtime_checkable
class SupportsPrefixLookup(Protocol):
    """An engine that says how many leading tokens of a prompt its prefix cache holds."""

    def cached_tokens(self, prompt: list[int], prefix_len: int, chunk: int) -> int:
        """Tokens of ``prompt`` an answer admitted now would load from the cache, with the
        first ``prefix_len`` as the chunking prefix and ``chunk``-token prefill chunks."""
        ...


@runtime_checkable
class SupportsPrefixPin(Protocol):
    """An engine that pins a prompt's cached chain until the answer that runs it is admitted
    (:meth:`generation.engine.core.Engine.pin`)."""

    def pin(self, prompt: list[int], prefix_len: int, chunk: int) -> object | None:
        """A handle with ``cached_tokens`` and an idempotent ``release()``, or None when the
        engine keeps no block cache."""
        ...


@runtime_checkable
class SupportsBatchSnapshot(Protocol):
    """An engine that shows the answers it runs and has been granted (decoding, prefilling)."""

    def batch_snapshot(self) -> BatchSnapshot:
        """The engine's batch now (:class:`generation.engine.messages.BatchSnapshot`)."""
        ...


@runtime_checkable
class SupportsStepBudget(Protocol):
    """An engine that runs at most ``step_token_budget`` tokens per step."""

    step_token_budget: int


@runtime_checkable
class SupportsRecentSteps(Protocol):
    """An engine that keeps its latest timed steps (:class:`generation.engine.messages.StepRecord`)."""

    def recent_steps(self) -> Sequence[StepRecord]:
        """The latest steps, oldest first."""
        ...


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting characters.

    The method of Hugging Face TGI and vLLM (``detokenize_incrementally``): decode
    a short window before and after the new token and emit the difference; hold
    the text back while it ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    decode: Any  # (ids: list[int]) -> str
    ids: list[int] = field(default_factory=list)  # (tokens so far,)
    prefix_offset: int = 0  # ids[prefix_offset:read_offset]: the window already emitted
    read_offset: int = 0  # ids[read_offset:]: tokens not yet emitted as text

    def add(self, token_id: int) -> str:
        """Append ``token_id``; return the text it completes (possibly ``""``)."""
        self.ids.append(token_id)
        prefix_text = self.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return str(delta)
        return ""

    def flush(self) -> str:
        """Text still held back at the end (an unfinished character decodes as U+FFFD)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self.decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return str(new_text[len(prefix_text):])
