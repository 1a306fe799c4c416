"""The load a remote engine carries, read in the background from its ``GET /slots`` and
``GET /metrics``.

A remote engine is shared: clients that do not go through ragbudget keep it busy, and
ragbudget's own queue cannot see them. Two signals are read, beside the engine's API root:

* ``GET <root>/slots``, llama.cpp's native server (with ``--slots``; tools/server/README.md in
  llama.cpp): per slot ``id``, ``is_processing`` and, while it decodes, ``next_token`` (one
  object, or a list of one per sequence) with ``n_decoded`` (tokens generated so far) and
  ``n_remain`` (tokens it may still generate; -1 when unlimited). What each busy slot has left.
* ``GET <root>/metrics``, Prometheus text (parsed with ``prometheus_client``): the requests the
  engine runs and those it keeps waiting, by the first family of :data:`QUEUE_METRICS` it
  serves: llama.cpp (``--metrics``) ``llamacpp:requests_processing`` /
  ``llamacpp:requests_deferred``; vLLM ``vllm:num_requests_running`` /
  ``vllm:num_requests_waiting``; SGLang (``--enable-metrics``) ``sglang:num_running_reqs`` /
  ``sglang:num_queue_reqs`` (each summed over its label sets). ``/slots`` cannot see the
  requests a llama.cpp server has queued behind its slots (deferred); ``/metrics`` can. From the
  same body, the share of the engine's KV cache in use (0..1), by the first gauge of
  :data:`KV_USAGE_METRICS` it serves: vLLM ``vllm:kv_cache_usage_perc`` (V1; "1 means 100
  percent usage"), its older name ``vllm:gpu_cache_usage_perc``, SGLang ``sglang:token_usage``
  (the share of its KV token pool in use); the largest over the label sets (the fullest
  engine of a server that runs several decides whether a new request waits). llama.cpp's
  server reports none (its slots are its limit).

:class:`SlotLoad` reads both every ``interval_s`` seconds on a daemon thread and keeps the
latest reading (:class:`SlotReading`): the answer path never makes an HTTP call for it, it
reads a snapshot (a lock and a list copy). A route the server does not have (404, 501, or a
body that is not what it should be) is no longer read after its first answer; the thread ends
when neither route is there. A server that does not answer leaves the last reading to age
out (:meth:`SlotLoad.reading` returns None once it is older than ``max_age_s``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

#: ``(running, waiting)`` gauge names per engine family, in the order they are looked for.
#: Sources: llama.cpp tools/server/README.md ("GET /metrics"); vLLM docs "Production Metrics";
#: SGLang docs "Production Metrics".
QUEUE_METRICS: tuple[tuple[str, str], ...] = (
    ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
)

#: KV-cache use gauges (a fraction, 0..1), in the order they are looked for. Sources: vLLM docs
#: "Production Metrics" / ``vllm/v1/metrics/loggers.py`` (``kv_cache_usage_perc``, earlier
#: ``gpu_cache_usage_perc``); SGLang docs "Production Metrics" (``sglang:token_usage``).
KV_USAGE_METRICS: tuple[str, ...] = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                                     "sglang:token_usage")


@dataclass(frozen=True)
class SlotReading:
    """One read of the engine's load.

    ``total``: slots the server has (0 when only ``/metrics`` was read); ``busy``: one
    ``(n_decoded, n_remain)`` pair per request the engine is running (``n_remain`` -1: no limit,
    or not reported; from ``/metrics`` alone every pair is ``(0, -1)``); ``t``:
    ``time.perf_counter()`` seconds when it was read; ``waiting``: requests the engine holds in
    its own queue, not started (0 when it does not say); ``kv_usage``: the share of its KV cache
    in use, 0..1 (None when it does not say: :data:`KV_USAGE_METRICS`).
    """

    total: int
    busy: list[tuple[int, int]]
    t: float
    waiting: int = 0
    kv_usage: float | None = None


def parse_slots(body: Any, t: float) -> SlotReading | None:
    """The :class:`SlotReading` of a ``/slots`` JSON body read at ``t``; None when it is not a
    list of slot objects (a server without the route)."""
    if not isinstance(body, list) or not all(isinstance(s, dict) for s in body):
        return None
    busy: list[tuple[int, int]] = []
    for slot in body:
        if not slot.get("is_processing"):
            continue
        nxt = slot.get("next_token")
        first = nxt[0] if isinstance(nxt, list) and nxt else nxt
        decoded = remain = -1
        if isinstance(first, dict):
            decoded = int(first.get("n_decoded", -1)) if isinstance(first.get("n_decoded"), int) else -1
            remain = int(first.get("n_remain", -1)) if isinstance(first.get("n_remain"), int) else -1
        busy.append((max(decoded, 0), remain))
    return SlotReading(total=len(body), busy=busy, t=t)


def _samples(text: str) -> dict[str, list[float]] | None:
    """Every sample's value by sample name (one per label set) of a Prometheus text body;
    None when it is not Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values.setdefault(sample.name, []).append(float(sample.value))
    except ValueError:
        return None
    return values


def _queue(values: dict[str, list[float]]) -> tuple[int, int] | None:
    for running, waiting in QUEUE_METRICS:
        if running in values:
            return max(int(sum(values[running])), 0), max(int(sum(values.get(waiting, [0.0]))), 0)
    return None


def _kv_usage(values: dict[str, list[float]]) -> float | None:
    for name in KV_USAGE_METRICS:
        got = [v for v in values.get(name, []) if v == v]  # NaN: not a reading
        if got:
            return min(max(max(got), 0.0), 1.0)
    return None


def parse_queue_metrics(text: str) -> tuple[int, int] | None:
    """``(running, waiting)`` requests from a Prometheus text body, by the first family of
    :data:`QUEUE_METRICS` present (each gauge summed over its label sets; a missing waiting
    gauge counts 0); None when the body names none of them or is not Prometheus text."""
    values = _samples(text)
    return None if values is None else _queue(values)


def parse_kv_usage(text: str) -> float | None:
    """The share of the engine's KV cache in use (0..1, clipped) from a Prometheus text body: the
    first gauge of :data:`KV_USAGE_METRICS` present, the largest over its label sets; None when
    the body names none of them (llama.cpp) or is not Prometheus text."""
    values = _samples(text)
    return None if values is None else _kv_usage(values)


class SlotLoad:
    """A background reader of one engine's ``GET /slots`` and ``GET /metrics`` (see the module
    docstring).

    Args:
        base_url: the engine's API root (``.../v1``); ``/slots`` and ``/metrics`` are read
            beside it.
        interval_s: seconds between reads (> 0).
        api_key: sent as ``Authorization: Bearer`` when set.
        max_age_s: a reading older than this is not used (default: 5 intervals, at least 2 s).

    Raises:
        ValueError: ``interval_s`` not > 0.
    """

    def __init__(self, base_url: str, interval_s: float, *, api_key: str | None = None,
                 max_age_s: float | None = None) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be > 0")
        base = base_url.rstrip("/")
        root = base[:-3] if base.endswith("/v1") else base
        self.url = root + "/slots"
        self.metrics_url = root + "/metrics"
        self.interval_s = float(interval_s)
        self.max_age_s = float(max_age_s if max_age_s is not None else max(5 * interval_s, 2.0))
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._lock = threading.Lock()
        self._reading: SlotReading | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.supported: bool | None = None  # /slots; None until the server answered once
        self.metrics_supported: bool | None = None  # /metrics with a known queue family

    def start(self) -> SlotLoad:
        """Start the daemon thread (once); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ragbudget-slots", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reading (the thread ends within one interval)."""
        self._stop.set()

    def _get(self, client: httpx.Client | None, url: str) -> httpx.Response:
        if client is not None:
            return client.get(url, headers=self._headers, timeout=2.0)
        return httpx.get(url, headers=self._headers, timeout=2.0)

    def _read_slots(self, client: httpx.Client | None) -> tuple[bool, SlotReading | None]:
        """``(answered, reading)`` of ``/slots``; marks the route unsupported on a wrong answer."""
        if self.supported is False:
            return False, None
        try:
            r = self._get(client, self.url)
            reading = parse_slots(r.json(), time.perf_counter()) if r.status_code == 200 else None
        except httpx.HTTPError:
            return False, None
        except ValueError:
            reading = None
        if reading is None:
            self.supported = False if self.supported is None else self.supported
            return True, None
        self.supported = True
        return True, reading

    def _read_metrics(self, client: httpx.Client | None) -> tuple[bool, tuple[int, int, float | None] | None]:
        """``(answered, (running, waiting, kv_usage))`` of ``/metrics``; marks it unsupported
        when it is not served or names no known queue family."""
        if self.metrics_supported is False:
            return False, None
        try:
            r = self._get(client, self.metrics_url)
        except httpx.HTTPError:
            return False, None
        values = _samples(r.text) if r.status_code == 200 else None
        queue = _queue(values) if values is not None else None
        if values is None or queue is None:
            self.metrics_supported = False if self.metrics_supported is None else self.metrics_supported
            return True, None
        self.metrics_supported = True
        return True, (queue[0], queue[1], _kv_usage(values))

    def read_once(self, client: httpx.Client | None = None) -> SlotReading | None:
        """Read ``/slots`` and ``/metrics`` now and keep the reading; None when the server gave
        neither (it did not answer, or has neither route).

        With both, ``busy`` comes from ``/slots`` and ``waiting`` and ``kv_usage`` from
        ``/metrics``; with ``/metrics`` alone, ``busy`` holds one ``(0, -1)`` per running request.
        """
        _, slots = self._read_slots(client)
        _, queue = self._read_metrics(client)
        t = time.perf_counter()
        if slots is not None:
            reading = SlotReading(slots.total, slots.busy, slots.t, queue[1] if queue else 0,
                                  queue[2] if queue else None)
        elif queue is not None:
            reading = SlotReading(0, [(0, -1)] * queue[0], t, queue[1], queue[2])
        else:
            return None  # unreachable now (or neither route): the last reading ages out
        with self._lock:
            self._reading = reading
        return reading

    def reading(self) -> SlotReading | None:
        """The latest reading, or None when there is none younger than ``max_age_s``."""
        with self._lock:
            got = self._reading
        if got is None or time.perf_counter() - got.t > self.max_age_s:
            return None
        return got

    def _loop(self) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                self.read_once(client)
                if self.supported is False and self.metrics_supported is False:
                    return
                self._stop.wait(self.interval_s)
