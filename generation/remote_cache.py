"""What a remote engine's automatic prefix cache holds, learned from the counts it reports.

vLLM (automatic prefix caching), SGLang (RadixAttention) and llama.cpp's server (its slots'
prompt cache) reuse the KV of a prompt prefix they computed recently; ragbudget cannot look
inside them, but it knows what it sent and each answer reports what the engine took from its
cache: ``usage.prompt_tokens_details.cached_tokens`` (vLLM, SGLang, OpenAI) or
``timings.cache_n`` (llama.cpp). :class:`RemotePrefixMemory` combines the two:

* **expected**: the longest common token prefix of a new prompt with any of the last
  ``max_prompts`` prompts this process sent to the engine (what a cache that kept every one
  of them would serve);
* **hit ratio**: over the last ``window`` answers for which the engine reported a count and
  ``expected`` was positive, ``sum(reported) / sum(expected)`` (how much of that the engine
  really gave: below 1 when its cache is smaller, per slot, or evicts; 0 when it caches
  nothing, e.g. vLLM without ``--enable-prefix-caching``);
* **predicted cached tokens** (:meth:`predict`): ``floor(expected x ratio)``. Until
  ``min_samples`` answers were learned, the prediction is at most the chunking prefix (the
  scaffold), the assumption ragbudget made before it learned anything; a ratio under
  ``min_ratio`` predicts 0, scaffold included: no hit the engine does not give is assumed.

The counts are an estimate of another program's cache, never a promise: the measured prefill
of every answer still feeds the online correction (:mod:`latency_model.correction`), and the
receipt records what the engine reported, not what was predicted.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from foundation.hashing import sha256_ints

#: Prompts remembered per engine (each kept as its token ids; 64 prompts of 4096 ids ~ 2 MiB).
MAX_PROMPTS = 64
#: Answers the hit ratio is taken over.
WINDOW = 32
#: Answers learned before a prediction may pass the chunking prefix.
MIN_SAMPLES = 4
#: A hit ratio below this predicts no cached token at all.
MIN_RATIO = 0.25


def common_prefix(a: list[int] | np.ndarray, b: list[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two token-id sequences (0 when the first ids
    differ). Vectorised: one element-wise comparison of the shorter length, then the first
    mismatch (``numpy.flatnonzero``), so a 4096-id prompt costs microseconds, not a Python loop
    per id."""
    x, y = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    n = min(x.size, y.size)
    if n == 0:
        return 0
    diff = np.flatnonzero(x[:n] != y[:n])
    return int(diff[0]) if diff.size else n


class RemotePrefixMemory:
    """The prompts sent to one remote engine and how much of their shared prefixes it served.

    Thread-safe; every method is O(``max_prompts`` x prompt length) at most.

    Raises:
        ValueError: a non-positive ``max_prompts``, ``window`` or ``min_samples``, or
            ``min_ratio`` outside ``[0, 1]``.
    """

    def __init__(self, max_prompts: int = MAX_PROMPTS, window: int = WINDOW,
                 min_samples: int = MIN_SAMPLES, min_ratio: float = MIN_RATIO) -> None:
        if max_prompts < 1 or window < 1 or min_samples < 1 or not 0.0 <= min_ratio <= 1.0:
            raise ValueError("max_prompts, window and min_samples must be >= 1, min_ratio in [0, 1]")
        self.max_prompts, self.min_samples, self.min_ratio = max_prompts, min_samples, min_ratio
        self._prompts: dict[str, np.ndarray] = {}
        self._order: deque[str] = deque()
        self._learned: deque[tuple[int, int]] = deque(maxlen=window)
        # The remembered prompts as one matrix, padded with -1 (never a token id), built on
        # the first lookup after a change: one comparison covers every prompt at once.
        self._matrix: np.ndarray | None = None
        self._lock = threading.Lock()

    def expected(self, ids: list[int]) -> int:
        """Longest common prefix of ``ids`` with any remembered prompt (tokens, ``<= len(ids)``)."""
        x = np.asarray(ids, dtype=np.int64)
        with self._lock:
            if not self._prompts or x.size == 0:
                return 0
            if self._matrix is None:
                width = max(p.size for p in self._prompts.values())
                self._matrix = np.full((len(self._prompts), width), -1, dtype=np.int64)
                for row, p in zip(self._matrix, self._prompts.values(), strict=True):
                    row[:p.size] = p
            matrix = self._matrix
        n = min(x.size, matrix.shape[1])
        equal = matrix[:, :n] == x[:n]
        # Per prompt, the first position that differs (argmin of a boolean row), or n.
        first = np.where(equal.all(axis=1), n, equal.argmin(axis=1))
        return int(first.max())

    def remember(self, ids: list[int]) -> None:
        """Remember ``ids`` as sent (the newest; the oldest past ``max_prompts`` is forgotten)."""
        key = sha256_ints(list(ids))
        with self._lock:
            if key in self._prompts:
                self._order.remove(key)
            self._prompts[key] = np.asarray(ids, dtype=np.int64)
            self._order.append(key)
            while len(self._order) > self.max_prompts:
                self._prompts.pop(self._order.popleft(), None)
            self._matrix = None

    def observe(self, expected: int, reported: int) -> None:
        """Learn one answer: ``expected`` from :meth:`expected` before it was sent, ``reported``
        the cached tokens the engine said it used. Answers with ``expected == 0`` teach nothing
        about hits and are skipped; ``reported`` is clamped to ``[0, expected]`` (an engine may
        serve a prefix this process did not send, e.g. another client's)."""
        if expected <= 0:
            return
        with self._lock:
            self._learned.append((expected, max(0, min(int(reported), expected))))

    @property
    def samples(self) -> int:
        """Answers the hit ratio is taken over now."""
        with self._lock:
            return len(self._learned)

    def hit_ratio(self) -> float | None:
        """``sum(reported) / sum(expected)`` over the window, or None before ``min_samples``."""
        with self._lock:
            if len(self._learned) < self.min_samples:
                return None
            return sum(r for _, r in self._learned) / sum(e for e, _ in self._learned)

    def predict(self, ids: list[int], prefix_len: int) -> int:
        """Tokens of ``ids`` the engine is predicted to take from its cache (see module):
        ``min(expected, prefix_len)`` before learning, else ``floor(expected x ratio)``, and 0
        when the ratio is under ``min_ratio``."""
        expected = self.expected(ids)
        ratio = self.hit_ratio()
        if ratio is None:
            return min(expected, max(0, prefix_len))
        if ratio < self.min_ratio:
            return 0
        return int(expected * ratio)

    def status(self) -> dict[str, float | int | None]:
        """``{"prompts", "samples", "hit_ratio"}`` for metrics and ``/v1/engines``-style views."""
        with self._lock:
            prompts = len(self._prompts)
        return {"prompts": prompts, "samples": self.samples, "hit_ratio": self.hit_ratio()}
