"""The load a llama.cpp server carries, read in the background from its ``GET /slots``.

A remote engine is shared: clients that do not go through ragbudget keep its slots busy,
and ragbudget's own queue cannot see them. llama.cpp's native server lists its slots at
``GET <root>/slots`` (with ``--slots``; tools/server/README.md in llama.cpp): per slot
``id``, ``is_processing`` and, while it decodes, ``next_token`` (one object, or a list of one
per sequence) with ``n_decoded`` (tokens generated so far) and ``n_remain`` (tokens it may
still generate; -1 when unlimited), and ``params.n_predict`` (its ``max_tokens``).

:class:`SlotLoad` reads that route every ``interval_s`` seconds on a daemon thread and keeps
the latest reading (:class:`SlotReading`): the answer path never makes an HTTP call for it,
it reads a snapshot (a lock and a list copy). A server without the route (vLLM, SGLang,
llama-cpp-python: 404, or anything not a JSON list) is stopped being polled after its first
answer; a server that does not answer leaves the last reading to age out
(:meth:`SlotLoad.reading` returns None once it is older than ``max_age_s``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class SlotReading:
    """One read of ``/slots``.

    ``total``: slots the server has; ``busy``: one ``(n_decoded, n_remain)`` pair per slot
    that is processing (``n_remain`` -1: no limit, or not reported); ``t``:
    ``time.perf_counter()`` seconds when it was read.
    """

    total: int
    busy: list[tuple[int, int]]
    t: float


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


class SlotLoad:
    """A background reader of one llama.cpp server's ``GET /slots`` (see the module docstring).

    Args:
        base_url: the engine's API root (``.../v1``); ``/slots`` is read beside it.
        interval_s: seconds between reads (> 0).
        api_key: sent as ``Authorization: Bearer`` when set.
        max_age_s: a reading older than this is not used (default: 5 intervals, at least 2 s).
    """

    def __init__(self, base_url: str, interval_s: float, *, api_key: str | None = None,
                 max_age_s: float | None = None) -> None:
        if not interval_s > 0:
            raise ValueError("interval_s must be > 0")
        base = base_url.rstrip("/")
        self.url = (base[:-3] if base.endswith("/v1") else base) + "/slots"
        self.interval_s = float(interval_s)
        self.max_age_s = float(max_age_s if max_age_s is not None else max(5 * interval_s, 2.0))
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._lock = threading.Lock()
        self._reading: SlotReading | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.supported: bool | None = None  # None until the server answered once

    def start(self) -> SlotLoad:
        """Start the daemon thread (once); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ragbudget-slots", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reading (the thread ends within one interval)."""
        self._stop.set()

    def read_once(self, client: httpx.Client | None = None) -> SlotReading | None:
        """Read ``/slots`` now and keep the reading; None when the server did not answer with one.

        A 404 or a body that is not a list of slots marks the server as not supporting the route
        (``supported`` False), and the background thread stops.
        """
        try:
            if client is not None:
                r = client.get(self.url, headers=self._headers, timeout=2.0)
            else:
                r = httpx.get(self.url, headers=self._headers, timeout=2.0)
            reading = parse_slots(r.json(), time.perf_counter()) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None  # unreachable now: the last reading ages out
        if reading is None:
            self.supported = False if self.supported is None else self.supported
            return None
        self.supported = True
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
                if self.supported is False:
                    return
                self._stop.wait(self.interval_s)
