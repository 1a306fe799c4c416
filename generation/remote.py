"""The remote backend: any OpenAI-compatible streaming server (vLLM, SGLang, ragbudget itself).

Requests go to ``<base_url>/completions`` with the prompt as token ids when the
server accepts that (vLLM and SGLang do); else as text that the server tokenizes
back to the same ids (llama-cpp-python's server, :mod:`generation.remote_text`,
checked per prompt through its tokenize route); else to
``<base_url>/chat/completions`` with chat messages. ``mode="auto"`` probes once, in
that order, with one-token requests.

Client-side timing follows vLLM's benchmark definitions
(``benchmarks/backend_request_func.py``): TTFT is the arrival of the first chunk
with non-empty text; role-only, empty and usage-only chunks are ignored; TPOT
is ``(t_last - t_first) / (output_tokens - 1)`` with output tokens counted once
with the model's tokenizer. A stream that ends without ``data: [DONE]`` is not an
answer: what arrived is yielded, then :class:`BackendError` is raised.

Calibration timers (client-side, network included, documented approximations):
``prefill_ms`` is the time to the first chunk of a ``max_tokens=1`` request
whose first ``cached_tokens`` ids were sent just before (so a server with
automatic prefix caching holds them) and whose rest is fresh random text;
``decode_step_ms`` is the gap between the two chunks of a ``max_tokens=2``
request (or first chunk to end of stream when the server sends one chunk).
"""

from __future__ import annotations

import json
import platform
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import httpx

from foundation.errors import BackendError, InvalidInput, RagBudgetError
from foundation.hashing import sha256_ints
from generation.base import GenerationStats, GenParams, StreamBody, TokenEvent, TokenStream
from generation.remote_cache import RemotePrefixMemory
from generation.remote_deadline import (
    FirstTokenWatch,
    first_token_timeout,
    header_timeout,
    restore_read_timeout,
)
from generation.remote_text import TextPromptCodec
from retrieval.tokens import TextTokenizer

DEFAULT_CONTEXT_WINDOW = 4096
_FILLER = ("The maintenance log records each inspection of the pump station, the valves, the "
           "filters and the pressure gauges, with the date, the engineer and what was found. ")


def iter_sse_data(lines: Iterable[str]) -> Iterator[str]:
    """Yield the ``data`` payload of each complete server-sent event.

    Multi-line data is joined with ``\\n``; comments (``:``) and other fields are
    skipped. An event still open when the lines end is incomplete and dropped
    (WHATWG HTML, "Server-sent events", interpreting an event stream).
    """
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)


class RemoteGenerator:
    """:class:`generation.base.Generator` over an OpenAI-compatible HTTP server.

    Args:
        base_url: API root including the version, e.g. ``http://127.0.0.1:8001/v1``.
        model: model name sent with every request.
        tokenizer: the served model's tokenizer (counts and synthetic prompts).
        api_key: sent as ``Authorization: Bearer``.
        tokenizer_source: the ``remote_tokenizer`` setting; a directory with a
            ``config.json`` also provides :meth:`config_dict`.
        mode: ``"auto"`` (probe), ``"completions"`` (token ids), ``"text"`` (completions
            with the prompt as text, see :mod:`generation.remote_text`) or ``"chat"``.
        context_window: default: the server's ``max_model_len`` from ``/models``, else 4096.
        timeout_s: read timeout per chunk.
        stop_token_ids: the chat template's end-of-turn ids, sent as ``stop_token_ids``
            (a vLLM/SGLang request field; servers that do not know it ignore it and stop at
            their own end-of-generation set, as llama.cpp does for ``<end_of_turn>``).
        max_running: how many requests ragbudget sends at once (the answer queue lets this
            many in). ``None``: what the server says (llama.cpp's ``GET /props``
            ``total_slots``, its ``--parallel``), else 1. A server that batches (vLLM,
            SGLang) says nothing, so set it (``RAGBUDGET_REMOTE_MAX_RUNNING``).
    """

    def __init__(self, base_url: str, model: str, *, tokenizer: TextTokenizer, api_key: str | None = None,
                 tokenizer_source: str | None = None,
                 mode: Literal["auto", "completions", "text", "chat"] = "auto",
                 context_window: int | None = None, timeout_s: float = 120.0,
                 stop_token_ids: list[int] | None = None, max_running: int | None = None) -> None:
        if max_running is not None and max_running < 1:
            raise InvalidInput(f"max_running must be >= 1, got {max_running}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer
        self.tokenizer_source = tokenizer_source
        self.mode = mode
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._text = TextPromptCodec(self._client, self.base_url, model, tokenizer)
        self.context_window = context_window or self._server_context_window() or DEFAULT_CONTEXT_WINDOW
        self.eos_token_ids: list[int] = sorted({int(i) for i in stop_token_ids or []})
        self._sent_prefixes: OrderedDict[str, None] = OrderedDict()
        self.prefix_memory = RemotePrefixMemory()
        self._lock = threading.Lock()
        self._prefix_lock = threading.Lock()
        self.max_running = max_running or self._server_slots() or 1
        self.identity: dict[str, Any] = {
            "backend": "remote", "model_id": model, "base_url": self.base_url, "weights_hash": None,
            "dtype": None, "device": "remote", "device_name": f"remote: {self.base_url}", "threads": None,
            "context_window": self.context_window, "tokenizer_id": tokenizer.tokenizer_id, "mode": mode,
            "software": {"python": platform.python_version(), "httpx": httpx.__version__},
        }

    # --- public contract ----------------------------------------------------------------
    def stream(self, prompt_ids: list[int], *, cached_prefix_ids: list[int] | None = None,
               params: GenParams, cancel: threading.Event | None = None,
               messages: list[dict[str, str]] | None = None,
               prefill_chunk: int | None = None) -> TokenStream:
        """See :meth:`generation.base.Generator.stream`.

        ``messages`` (``Prompt.messages``) is what a chat-only server receives; without
        it the decoded prompt is sent as one user message. The request is sent at the
        stream's first ``next()`` (the server owns its own waiting line);
        ``prefill_chunk`` is ignored (the server chunks its prefill its own way).

        Raises:
            InvalidInput: empty prompt, or parameters outside their ranges
                (:meth:`GenParams.validate`, code ``invalid_sampling_parameter``).
            BackendError: HTTP failure, an error chunk, or a stream without ``[DONE]``.
        """
        if not prompt_ids:
            raise InvalidInput("the prompt is empty")
        params.validate()
        if cached_prefix_ids and list(prompt_ids[:len(cached_prefix_ids)]) == list(cached_prefix_ids):
            self._remember_prefix(list(cached_prefix_ids))
        ids, resolved = list(prompt_ids), params.resolved()
        return TokenStream(lambda stream: self._run(stream, ids, resolved, cancel, messages))

    def prefix_cached(self, prefix_ids: list[int]) -> bool:
        """True when this process already sent ``prefix_ids`` (the server's prefix cache likely
        holds it), unless the engine's reported counts showed it gives no hits
        (:class:`generation.remote_cache.RemotePrefixMemory`, hit ratio under its minimum)."""
        ratio = self.prefix_memory.hit_ratio()
        if ratio is not None and ratio < self.prefix_memory.min_ratio:
            return False
        key = sha256_ints(list(prefix_ids))
        with self._prefix_lock:
            return key in self._sent_prefixes

    def cached_tokens(self, prompt: list[int], prefix_len: int, chunk: int) -> int:
        """Tokens of ``prompt`` the server's prefix cache is predicted to serve, learned from the
        cached-token counts it reported (:meth:`generation.remote_cache.RemotePrefixMemory.predict`;
        ``prefix_len`` is the scaffold, assumed cached before anything is learned; ``chunk`` is
        ignored: the server chunks its prefill its own way). In ``[0, len(prompt)]``."""
        return min(len(prompt), self.prefix_memory.predict(list(prompt), prefix_len))

    def warm_prefix(self, prefix_ids: list[int]) -> float:
        """Send ``prefix_ids`` with ``max_tokens=1`` so the server caches it; ms spent (0 in chat mode)."""
        if self._mode() == "chat":
            return 0.0
        t0 = time.perf_counter()
        self._timed_request(list(prefix_ids), max_tokens=1)
        self._remember_prefix(list(prefix_ids))
        self.prefix_memory.remember(list(prefix_ids))
        return (time.perf_counter() - t0) * 1000.0

    def prefill_ms(self, prompt_tokens: int, cached_tokens: int) -> float:
        """Client-side time to the first chunk of a ``max_tokens=1`` request, ms (see module docstring).

        Raises:
            InvalidInput: not ``0 <= cached_tokens <= prompt_tokens``, or ``prompt_tokens < 1``.
        """
        if not 0 <= cached_tokens <= prompt_tokens or prompt_tokens < 1:
            raise InvalidInput(f"bad prefill shape n={prompt_tokens} c={cached_tokens}")
        prefix = self._filler_ids(cached_tokens, seed=0)
        if cached_tokens:
            self._timed_request(prefix, max_tokens=1)
        ids = prefix + self._filler_ids(prompt_tokens - cached_tokens, seed=random.randrange(2**31))
        start, times = self._timed_request(ids, max_tokens=1)
        return (times[0] - start) * 1000.0 if times else float("nan")

    def decode_step_ms(self, context_tokens: int) -> float:
        """Client-side gap between the two chunks of a ``max_tokens=2`` request, ms."""
        if context_tokens < 1:
            raise InvalidInput(f"bad decode context {context_tokens}")
        ids = self._filler_ids(context_tokens, seed=random.randrange(2**31))
        _start, times = self._timed_request(ids, max_tokens=2, end_time=True)
        return (times[1] - times[0]) * 1000.0 if len(times) >= 2 else float("nan")

    def config_dict(self) -> dict[str, Any]:
        """Shape from ``<remote_tokenizer>/config.json`` when it is a model directory, else ``{}``.

        ``num_parameters`` is estimated from the shapes (dense decoder, gated MLP,
        untied embeddings counted once) and flagged ``num_parameters_estimated``.
        """
        path = Path(self.tokenizer_source or "") / "config.json"
        if not self.tokenizer_source or not path.is_file():
            return {}
        c = json.loads(path.read_text())
        h, layers, heads = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or h // heads)
        inter = int(c.get("intermediate_size") or 4 * h)
        vocab = int(c["vocab_size"])
        per_layer = 2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * inter
        return {"model_type": c.get("model_type"), "num_parameters": layers * per_layer + vocab * h,
                "num_parameters_estimated": True, "num_hidden_layers": layers, "hidden_size": h,
                "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
                "vocab_size": vocab, "intermediate_size": inter,
                "max_position_embeddings": c.get("max_position_embeddings")}

    def close(self) -> None:
        """Close the HTTP client and its connections; the generator is unusable afterwards."""
        self._client.close()

    # --- streaming --------------------------------------------------------------------------
    def _run(self, stream: TokenStream, prompt_ids: list[int], params: GenParams,
             cancel: threading.Event | None, messages: list[dict[str, str]] | None) -> StreamBody:
        """The body of one answer's :class:`TokenStream`: nothing before its first ``yield``
        (the request goes out at the first ``next()``), then the server's text chunks; the
        stats set on every path once the request was started."""
        yield None
        expected = self.prefix_memory.expected(prompt_ids)
        stats = GenerationStats(prompt_tokens=len(prompt_ids), cached_tokens=0,
                                computed_tokens=len(prompt_ids), output_token_ids=[],
                                finish_reason="stop", prefill_ms=0.0, first_token_t=None,
                                last_token_t=None, params=params)
        texts: list[str] = []
        deadline_t: float | None = None
        watch: FirstTokenWatch | None = None
        try:
            stats.start_t = time.perf_counter()
            if cancel is not None and cancel.is_set():
                stats.finish_reason = "cancelled"
                return
            mode = self._mode()
            url, payload = self._payload(mode, prompt_ids, params, messages, max_tokens=params.max_new_tokens)
            payload["stream_options"] = {"include_usage": True}
            if mode == "text":
                engine_prompt = self._text.verify(prompt_ids, payload["prompt"])
                stats.engine_prompt = engine_prompt.to_dict() if engine_prompt else None
            done = False
            deadline_t = stream.first_token_deadline_t
            extra: dict[str, Any] = {}
            if deadline_t is not None:
                if time.perf_counter() >= deadline_t:  # due before it was sent: not sent
                    raise first_token_timeout(self.base_url, 0.0, (deadline_t - stats.start_t) * 1000.0,
                                              sent=False)
                extra["timeout"] = header_timeout(self._client.timeout, deadline_t, time.perf_counter())
            with self._client.stream("POST", url, json=payload, **extra) as resp:
                if resp.status_code >= 400:
                    body = resp.read().decode("utf-8", "replace")[:500]
                    raise BackendError(f"remote server answered HTTP {resp.status_code}: {body}",
                                       status=resp.status_code)
                if deadline_t is not None:
                    restore_read_timeout(resp, self._client.timeout)
                    watch = FirstTokenWatch(resp, deadline_t)
                for data in iter_sse_data(resp.iter_lines()):
                    if data.strip() == "[DONE]":
                        done = watch is None or watch.disarm() or stats.first_token_t is not None
                        break
                    t = time.perf_counter()
                    text, finish = self._parse_chunk(data, mode, stats)
                    if finish:
                        stats.finish_reason = "length" if finish == "length" else "stop"
                    if text:
                        if stats.first_token_t is None and watch is not None and not watch.disarm():
                            break  # the deadline passed as the token came: timed out
                        index = len(texts)
                        texts.append(text)
                        if stats.first_token_t is None:
                            stats.first_token_t = stats.first_text_t = t
                            stats.prefill_ms = (t - stats.start_t) * 1000.0
                        stats.last_token_t = t
                        yield TokenEvent(index, -1, text, t)
                    if cancel is not None and cancel.is_set():
                        stats.finish_reason = "cancelled"
                        return
            if watch is not None and watch.fired and stats.first_token_t is None:
                raise self._timed_out(stats, deadline_t)
            if not done:
                raise BackendError("remote stream ended without [DONE]; the answer is incomplete",
                                   chunks=len(texts))
        except GeneratorExit:
            stats.finish_reason = "cancelled"
            raise
        except RagBudgetError as exc:
            stats.finish_reason, stats.error = "error", str(exc)
            raise
        except (httpx.HTTPError, ValueError) as exc:
            stats.finish_reason, stats.error = "error", f"{type(exc).__name__}: {exc}"
            if stats.first_token_t is None and deadline_t is not None and (
                    (watch is not None and watch.fired)
                    or (isinstance(exc, httpx.TimeoutException) and time.perf_counter() >= deadline_t)):
                err = self._timed_out(stats, deadline_t)
                stats.error = str(err)
                raise err from exc
            raise BackendError(f"remote generation failed: {exc}") from exc
        finally:
            if watch is not None:
                watch.disarm()
            stats.output_token_ids = self.tokenizer.encode("".join(texts)) if texts else []
            if stats.first_token_t is not None:  # the server computed (and may cache) this prompt
                if stats.cache_reported:
                    self.prefix_memory.observe(expected, stats.cached_tokens)
                self.prefix_memory.remember(prompt_ids)
            stream.stats = stats

    def _timed_out(self, stats: GenerationStats, deadline_t: float | None) -> BackendError:
        """The ``first_token_timeout`` error of a stream sent at ``stats.start_t`` whose first
        token did not come by ``deadline_t`` (:mod:`generation.remote_deadline`)."""
        start = stats.start_t if stats.start_t is not None else time.perf_counter()
        allowed = None if deadline_t is None else (deadline_t - start) * 1000.0
        return first_token_timeout(self.base_url, (time.perf_counter() - start) * 1000.0, allowed)

    @staticmethod
    def _parse_chunk(data: str, mode: str, stats: GenerationStats) -> tuple[str, str | None]:
        """``(text, finish_reason)`` of one chunk; records usage. Raises BackendError on an error chunk."""
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise BackendError("remote stream sent a non-object chunk")
        if obj.get("error"):
            err = obj["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            raise BackendError(f"remote server error: {message}")
        timings = obj.get("timings")
        if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
            # llama.cpp's native server: prompt tokens taken from its slot's cache
            # (tools/server/server.cpp, ``timings.cache_n``), on the final chunk.
            cached_n = int(timings["cache_n"])
            if 0 <= cached_n <= stats.prompt_tokens:
                stats.cached_tokens, stats.computed_tokens = cached_n, stats.prompt_tokens - cached_n
                stats.cache_reported = True
        usage = obj.get("usage")
        if isinstance(usage, dict):
            stats.usage = usage
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if isinstance(cached, int) and 0 <= cached <= stats.prompt_tokens:
                stats.cached_tokens, stats.computed_tokens = cached, stats.prompt_tokens - cached
                stats.cache_reported = True
        choices = obj.get("choices") or []
        if not choices:
            return "", None
        choice = choices[0]
        text = choice.get("text") if mode != "chat" else (choice.get("delta") or {}).get("content")
        return (text or ""), choice.get("finish_reason")

    # --- requests -----------------------------------------------------------------------------
    def _payload(self, mode: str, prompt_ids: list[int], params: GenParams,
                 messages: list[dict[str, str]] | None, *, max_tokens: int) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "stream": True,
                                "temperature": params.temperature}
        if not params.greedy:
            body["top_p"] = params.top_p
            body["seed"] = params.seed
        # vLLM's request extensions (SGLang and llama.cpp's server read the same names), sent
        # only when set so a plain OpenAI server never sees them. With ignore_eos the end-of-turn
        # ids are not sent as stop ids either: vLLM would still stop at those.
        if params.ignore_eos:
            body["ignore_eos"] = True
        elif self.eos_token_ids:
            body["stop_token_ids"] = list(self.eos_token_ids)
        if params.min_tokens:
            body["min_tokens"] = params.min_tokens
        if mode in ("completions", "text"):
            body["prompt"] = prompt_ids if mode == "completions" else self._text.text_for(prompt_ids)
            return f"{self.base_url}/completions", body
        body["messages"] = messages or [{"role": "user", "content": self.tokenizer.decode(prompt_ids)}]
        return f"{self.base_url}/chat/completions", body

    def _timed_request(self, prompt_ids: list[int], max_tokens: int,
                       end_time: bool = False) -> tuple[float, list[float]]:
        """Send a greedy streaming request; ``(start, arrival times of chunks with a choice)``."""
        mode = self._mode()
        url, payload = self._payload(mode, prompt_ids, GenParams(), None, max_tokens=max_tokens)
        times: list[float] = []
        start = time.perf_counter()
        try:
            with self._client.stream("POST", url, json=payload) as resp:
                if resp.status_code >= 400:
                    raise BackendError(f"remote server answered HTTP {resp.status_code}")
                for data in iter_sse_data(resp.iter_lines()):
                    if data.strip() == "[DONE]":
                        break
                    obj = json.loads(data)
                    choice = (obj.get("choices") or [None])[0]
                    if choice and ((choice.get("text") if mode != "chat"
                                    else (choice.get("delta") or {}).get("content"))
                                   or choice.get("finish_reason")):
                        times.append(time.perf_counter())
        except httpx.HTTPError as exc:
            raise BackendError(f"remote request failed: {exc}") from exc
        if end_time and len(times) == 1:
            times.append(time.perf_counter())
        return start, times

    def _mode(self) -> str:
        """The request mode, probing once in ``auto``: token-id completions, text completions, chat."""
        with self._lock:
            if self.mode == "auto":
                probe = {"model": self.model, "prompt": self.tokenizer.encode("Hello")[:1] or [0],
                         "max_tokens": 1, "stream": False}
                try:
                    r = self._client.post(f"{self.base_url}/completions", json=probe)
                    ok = r.status_code == 200 and bool(r.json().get("choices"))
                except (httpx.HTTPError, ValueError):
                    ok = False
                self.mode = "completions" if ok else "text" if self._text.probe() else "chat"
                self.identity["mode"] = self.mode
            elif self.mode == "text" and not self._text.probed and not self._text.probe():
                raise BackendError(f"{self.base_url} does not answer a text completion request")
            return self.mode

    def _server_context_window(self) -> int | None:
        try:
            r = self._client.get(f"{self.base_url}/models", timeout=5.0)
            for m in r.json().get("data", []):
                if m.get("id") == self.model and isinstance(m.get("max_model_len"), int):
                    return int(m["max_model_len"])
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return None

    def _server_slots(self) -> int | None:
        """llama.cpp's ``total_slots`` from ``GET <root>/props`` (its ``--parallel``), else None.

        The route sits beside ``/v1`` on llama.cpp's native server (tools/server/README.md,
        ``GET /props``); other servers answer 404 and say nothing here.
        """
        root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        try:
            r = self._client.get(f"{root}/props", timeout=5.0)
            slots = r.json().get("total_slots") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return int(slots) if isinstance(slots, int) and slots >= 1 else None

    def _remember_prefix(self, prefix_ids: list[int]) -> None:
        key = sha256_ints(prefix_ids)
        with self._prefix_lock:
            self._sent_prefixes[key] = None
            self._sent_prefixes.move_to_end(key)
            while len(self._sent_prefixes) > 16:
                self._sent_prefixes.popitem(last=False)

    def _filler_ids(self, n: int, seed: int) -> list[int]:
        """``n`` token ids of natural text; ``seed`` shuffles the words so the text is fresh."""
        words = _FILLER.split()
        r = random.Random(seed)
        ids: list[int] = []
        while len(ids) < n:
            if seed:
                r.shuffle(words)
            ids += self.tokenizer.encode(" ".join(words) + " ")
        return ids[:n]
