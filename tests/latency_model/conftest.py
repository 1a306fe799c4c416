"""Fakes for the latency model tests: a timer with known coefficients and a fitted profile."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from latency_model.calibration import calibrate
from latency_model.grid import quick_grid
from latency_model.profile import Profile

TRUE_PREFILL = {"a": 12.0, "b": 0.9, "g": 2.5e-5}
TRUE_DECODE = {"d": 20.0, "e": 0.004}
IDENTITY = {"device": "cpu", "device_name": "Fake CPU 9000", "model_id": "fake/model-135m",
            "weights_hash": "sha256:" + "ab" * 32, "dtype": "float32", "threads": 2,
            "context_window": 8192, "backend": "local"}


class FakeTimer:
    """A PrefillTimer whose times follow the quadratic form times lognormal noise (seeded)."""

    def __init__(self, *, noise: float = 0.02, seed: int = 7, identity: dict[str, Any] | None = None,
                 prefill: dict[str, float] | None = None) -> None:
        self.identity = dict(identity or IDENTITY)
        self.noise = noise
        self.rng = random.Random(seed)
        self.coef = prefill or TRUE_PREFILL
        self.calls: list[tuple[str, int, int]] = []

    def _jitter(self) -> float:
        return math.exp(self.rng.gauss(0.0, self.noise)) if self.noise else 1.0

    def prefill_ms(self, prompt_tokens: int, cached_tokens: int) -> float:
        self.calls.append(("prefill", prompt_tokens, cached_tokens))
        m = prompt_tokens - cached_tokens
        k = self.coef
        return (k["a"] + k["b"] * m + k["g"] * m * (prompt_tokens + cached_tokens)) * self._jitter()

    def decode_step_ms(self, context_tokens: int) -> float:
        self.calls.append(("decode", context_tokens, 0))
        return (TRUE_DECODE["d"] + TRUE_DECODE["e"] * context_tokens) * self._jitter()


def no_cpu_probe() -> None:
    """A CPU probe that knows nothing: a fake timer's calls are never judged contended."""
    return None


@pytest.fixture(scope="session")
def fitted_profile() -> Profile:
    """A profile calibrated on a FakeTimer with 2 % noise over the quick grid (cached 0 and 200)."""
    return calibrate(FakeTimer(), grid=quick_grid(8192, [200]), seed=3, progress=False,
                     cpu_probe=no_cpu_probe)
