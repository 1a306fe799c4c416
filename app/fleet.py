"""The engines of one answer pipeline: each with its generator, queue, planning band and health.

A server answers over the engines of ``Settings.engine_list()`` (``RAGBUDGET_ENGINES``; one
engine, id ``default``, when no list is configured). Each :class:`FleetEngine` holds, for
one engine:

* its generator (``Services.engine_generator``: the first engine's is ``Services.generator``);
* its own :class:`app.answering.genqueue.GenerationQueue`, whose slots are the engine's ``max_running``
  (the local engine's batch size, a remote engine's setting or llama.cpp's ``/props``
  ``total_slots``);
* its own :class:`app.answering.bands.PlanBands`: the batch-aware band and the online correction of
  the profile in force for that engine's identity (profiles are keyed by the generator's
  identity, so two engines have two profiles and two corrections);
* its load from other clients, for a llama.cpp engine (:class:`generation.remote_load.SlotLoad`,
  read in the background, priced in its queue's predicted wait: :mod:`app.answering.genqueue`);
* its health (:class:`EngineHealth`): an engine that refuses connections, drops a stream
  before its first token, or sends no first token in time (:meth:`FleetEngine.arm_first_token`,
  :func:`first_token_allowed_ms`) is taken out of rotation, probed every
  ``engine_probe_interval_s`` in the background and brought back when it answers.

The pipeline plans each answer over every engine in rotation with
:func:`latency_model.fleet.choose` (``app.answering.pipeline``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import httpx

from app.answering.bands import PlanBands
from app.answering.genqueue import GenerationQueue
from app.settings import EngineConfig
from generation.base import SupportsMaxRunning

if TYPE_CHECKING:
    from app.answering.state import Prepared
    from generation.base import Generator, TokenStream
    from generation.remote_load import SlotLoad
    from latency_model.profile import Profile

log = logging.getLogger("ragbudget.fleet")

#: Errors of an engine that is not there: nothing was sent, or the connection was refused/cut
#: before the server answered (httpx's connect-level failures).
_GONE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
         ConnectionError)


#: The share of a remote engine's KV cache in use (its ``/metrics``, vLLM and SGLang:
#: :data:`generation.remote_load.KV_USAGE_METRICS`) from which a new request is priced as
#: waiting for a running one to end: a server with (almost) no free KV blocks queues or preempts
#: rather than admitting another prompt (vLLM's scheduler admits a request only when its blocks
#: can be allocated), so its free slots are not free. 0.9 leaves room for one long prompt on a
#: cache of tens of thousands of tokens; a judgement, not a measured constant.
KV_FULL_FRACTION = 0.9

#: How many times its predicted p95 a remote engine may take to its first token (plus
#: ``engine_first_token_margin_ms``) before it counts as stalled: the p95 is the fitted profile's
#: 95th percentile residual band, so twice it is far past the noise the profile was fitted on.
FIRST_TOKEN_P95_FACTOR = 2.0


def engine_gone(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it was raised from) says the engine cannot be reached:
    a refused or dropped connection (:data:`_GONE`), or a request it was sent and gave no first
    token for in time (code ``first_token_timeout``, :mod:`generation.remote_deadline`), not an
    answer the engine gave. A first-token deadline already due before the request was sent
    (``details["sent"]`` False) says nothing about the engine."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, _GONE):
            return True
        if getattr(cur, "code", None) == "first_token_timeout":
            return bool(getattr(cur, "details", {}).get("sent", True))
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def first_token_allowed_ms(p95_ms: float, margin_ms: float, budget_left_ms: float | None = None) -> float:
    """How long (ms, from the request's send) a remote engine has to send its first token.

    ``FIRST_TOKEN_P95_FACTOR * p95_ms + margin_ms``, where ``p95_ms`` is the plan's predicted p95
    TTFT on that engine from the send (the prefill of the chosen k plus the wait the engine's own
    queue adds); bounded by ``budget_left_ms`` (what is left of a budget the answer must make,
    ``on_budget_miss: reject``; None: not bounded), and never below 0.

    Raises:
        ValueError: ``p95_ms`` or ``margin_ms`` negative or not finite.
    """
    if not (0.0 <= p95_ms < float("inf")) or not (0.0 <= margin_ms < float("inf")):
        raise ValueError(f"p95_ms and margin_ms must be finite and >= 0, got {p95_ms}, {margin_ms}")
    allowed = FIRST_TOKEN_P95_FACTOR * p95_ms + margin_ms
    if budget_left_ms is not None:
        allowed = min(allowed, budget_left_ms)
    return max(allowed, 0.0)


def kv_full_load(remaining_ms: list[float], kv_usage: float | None, slots: int) -> list[float]:
    """The engine's busy-slot list (remaining ms each) as the queue prices it, given its KV-cache
    use: below :data:`KV_FULL_FRACTION` (or unknown) unchanged; at or above, padded with the
    mean remaining time of the busy slots to at least ``slots`` entries, so a new request is
    priced as waiting for one of them to end (:meth:`app.answering.genqueue.GenerationQueue.engine_wait_ms`)
    rather than as taking a free slot. An empty list stays empty (nothing runs: the cache is
    held by cached prefixes the server can evict)."""
    if kv_usage is None or kv_usage < KV_FULL_FRACTION or not remaining_ms or len(remaining_ms) >= slots:
        return remaining_ms
    mean = sum(remaining_ms) / len(remaining_ms)
    return remaining_ms + [mean] * (slots - len(remaining_ms))


class EngineHealth:
    """Whether an engine is in rotation; probes it in the background while it is out.

    Args:
        engine_id: for logs.
        probe_url: ``GET`` this; any HTTP answer below 500 brings the engine back. None: the
            engine is never taken out (the local engine).
        interval_s: seconds between probes.
        api_key: sent as ``Authorization: Bearer`` when set.
    """

    def __init__(self, engine_id: str, probe_url: str | None, interval_s: float,
                 api_key: str | None = None) -> None:
        self.engine_id = engine_id
        self.probe_url = probe_url
        self.interval_s = float(interval_s)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._lock = threading.Lock()
        self.healthy = True
        self.reason: str | None = None
        self.down_since: float | None = None
        self.downs = 0  # times taken out of rotation
        self._prober: threading.Thread | None = None
        self._closed = threading.Event()

    def mark_down(self, reason: str) -> None:
        """Take the engine out of rotation and start probing it (no-op without a probe URL)."""
        if self.probe_url is None:
            return
        with self._lock:
            if not self.healthy:
                return
            self.healthy, self.reason, self.down_since = False, reason, time.perf_counter()
            self.downs += 1
            self._prober = threading.Thread(target=self._probe_loop, daemon=True,
                                            name=f"ragbudget-probe-{self.engine_id}")
            self._prober.start()
        log.warning("engine %s out of rotation: %s", self.engine_id, reason)

    def probe(self) -> bool:
        """One probe now: True (and back in rotation) when the engine answers below HTTP 500."""
        assert self.probe_url is not None
        try:
            ok = httpx.get(self.probe_url, headers=self._headers, timeout=2.0).status_code < 500
        except httpx.HTTPError:
            ok = False
        if ok:
            with self._lock:
                was_down = not self.healthy
                self.healthy, self.reason, self.down_since = True, None, None
            if was_down:
                log.warning("engine %s back in rotation", self.engine_id)
        return ok

    def close(self) -> None:
        """Stop probing (the probe thread ends within one interval)."""
        self._closed.set()

    def _probe_loop(self) -> None:
        while not self._closed.wait(self.interval_s):
            if self.probe():
                return


class FleetEngine:
    """One engine of a pipeline (see the module docstring).

    Args:
        pipeline: the owning ``app.answering.pipeline.AnswerPipeline`` (its services, settings,
            switches and metrics).
        config: the engine's :class:`app.settings.EngineConfig`.
        position: its place in the configured list (the planner's last tie-break).
    """

    def __init__(self, pipeline: Any, config: EngineConfig, position: int) -> None:
        self._pipeline = pipeline
        self.config = config
        self.id = config.id
        self.position = position
        settings = pipeline.settings
        self.queue = GenerationQueue(settings.queue_max)
        services = pipeline.services
        self.bands = PlanBands(pipeline.switches, pipeline.metrics,
                               data_dir=lambda: getattr(services, "data_dir", None),  # a stand-in: none
                               correction_window=settings.correction_window,
                               generator=lambda: self.generator)
        interval = float(getattr(settings, "engine_probe_interval_s", 1.0))
        probe = None
        if config.kind == "remote" and config.base_url:
            probe = config.base_url.rstrip("/") + "/models"
        self.health = EngineHealth(config.id, probe, interval, config.api_key)
        self._load: SlotLoad | None = None
        self._load_lock = threading.Lock()
        #: The id of the profile the latest plan on this engine used (None before one).
        self.profile_id: str | None = None

    @property
    def generator(self) -> Generator:
        """The engine's generator (built on first use, once per process; the first engine's is
        ``services.generator``)."""
        services = self._pipeline.services
        if self.position == 0:
            return services.generator
        return services.engine_generator(self.id)

    @property
    def healthy(self) -> bool:
        """In rotation (see :class:`EngineHealth`)."""
        return self.health.healthy

    def profile(self) -> Profile:
        """The latency profile in force for this engine's generator
        (:func:`app.profile_store.current_profile`)."""
        from app.profile_store import current_profile

        return current_profile(self._pipeline.services, self.generator)

    def sync_slots(self) -> GenerationQueue:
        """The queue, its slots set to the generator's ``max_running`` (1 when it says none),
        and, for a remote engine, its load from other clients wired in (:meth:`start_load`)."""
        gen = self.generator
        self.queue.slots = max(1, int((gen.max_running if isinstance(gen, SupportsMaxRunning) else 1) or 1))
        return self.queue

    def start_load(self, profile: Profile) -> None:
        """Read a remote engine's ``/slots`` and ``/metrics`` in the background (once) and price
        its load in the queue's wait: each busy slot's tokens still allowed (``n_remain``;
        unlimited or unreported: ``default_max_new_tokens`` minus those decoded, at least 1), and
        each request the engine keeps waiting behind its slots ``default_max_new_tokens``, x the
        profile's TPOT at half the engine's context window (ms). The waiting requests count as
        foreign work ahead of a new answer (:meth:`app.answering.genqueue.GenerationQueue.foreign`). An
        engine whose KV cache is near full counts as having every slot busy
        (:func:`kv_full_load`). No-op for the local engine (its queue is the engine)."""
        if self.config.kind != "remote" or not self.config.base_url:
            return
        with self._load_lock:
            if self._load is not None:
                return
            from generation.remote_load import SlotLoad

            settings = self._pipeline.settings
            self._load = SlotLoad(self.config.base_url, float(settings.engine_probe_interval_s),
                                  api_key=self.config.api_key).start()
        default_new = int(settings.default_max_new_tokens)
        window = int(self.generator.context_window or 4096)
        tpot = float(profile.predict_tpot_ms(max(window // 2, 1)))
        load = self._load

        queue = self.queue

        def remaining() -> list[float] | None:
            reading = load.reading()
            if reading is None or not (reading.busy or reading.waiting):
                return None
            out = ([max(remain if remain >= 0 else default_new - decoded, 1) * tpot
                    for decoded, remain in reading.busy]
                   + [max(default_new, 1) * tpot] * reading.waiting)
            return kv_full_load(out, reading.kv_usage, queue.slots)

        self.queue.engine_load = remaining

    @property
    def load(self) -> SlotLoad | None:
        """The background reader of the engine's ``/slots`` (None before :meth:`start_load`, and
        for the local engine)."""
        return self._load

    def arm_first_token(self, stream: TokenStream | None, p: Prepared) -> float | None:
        """Set ``stream``'s first-token deadline (:attr:`TokenStream.first_token_deadline_t`) for
        the answer ``p`` granted on this engine now: :func:`first_token_allowed_ms` of the plan's
        p95 for the chosen k plus the wait the engine's own queue adds
        (:meth:`GenerationQueue.engine_wait_ms`), with ``engine_first_token_margin_ms``, bounded
        by what is left of the budget when the answer must make it (``on_budget_miss:
        reject``). Returns the ms allowed; None (no deadline) for the local engine, which is its
        own queue, and for no stream."""
        if stream is None or self.config.kind != "remote":
            return None
        settings = self._pipeline.settings
        now = time.perf_counter()
        rows = p.plan.rows
        k = min(p.plan.chosen_k or 0, len(rows) - 1) if rows else 0
        p95_ms = (float(rows[k].ttft_p95_ms) if rows else 0.0) + float(self.queue.engine_wait_ms())
        hard = (p.request.on_budget_miss or settings.on_budget_miss) == "reject"
        left_ms = p.budget_ms - (now - p.arrival_t) * 1000.0 if hard else None
        allowed = first_token_allowed_ms(p95_ms, float(settings.engine_first_token_margin_ms), left_ms)
        stream.first_token_deadline_t = now + allowed / 1000.0
        return allowed

    def predicted_wait_ms(self) -> float:
        """The queue's predicted wait, the load from other clients included
        (:mod:`app.answering.genqueue`)."""
        return self.queue.predicted_wait_ms()

    def in_flight(self) -> int:
        """ragbudget's requests running or waiting on this engine."""
        q = self.queue
        return len(q._running_places) + q.depth  # noqa: SLF001 - same room, read-only

    def foreign_load(self) -> bool:
        """True when the engine's last load reading shows more requests running or waiting
        than ragbudget's own (:meth:`in_flight`): another client is using it, and may have
        replaced what its prefix cache held of our prompts. False without a reading (the
        local engine, a server that says nothing)."""
        reading = self._load.reading() if self._load is not None else None
        return reading is not None and len(reading.busy) + reading.waiting > self.in_flight()

    def close(self) -> None:
        """Stop this engine's background threads (its ``/slots`` reader and its health probe)."""
        if self._load is not None:
            self._load.stop()
        self.health.close()

    def __del__(self) -> None:  # a pipeline dropped without close(): its threads end too
        with contextlib.suppress(Exception):  # at interpreter shutdown
            self.close()

    def status(self) -> dict[str, Any]:
        """A JSON-ready summary: id, kind, base URL, health, slots, queue depth, predicted wait,
        the engine's own load (busy slots, waiting requests, KV-cache use) as last read."""
        reading = self._load.reading() if self._load is not None else None
        return {"id": self.id, "kind": self.config.kind, "base_url": self.config.base_url,
                "healthy": self.healthy, "down_reason": self.health.reason,
                "slots": self.queue.slots, "queue_depth": self.queue.depth,
                "in_flight": self.in_flight(), "predicted_wait_ms": self.predicted_wait_ms(),
                "foreign_busy": len(self.queue.foreign()),
                "engine_busy": None if reading is None else len(reading.busy),
                "engine_waiting": None if reading is None else reading.waiting,
                "engine_kv_usage": None if reading is None else reading.kv_usage}
