"""A latency profile: fitted (or prior) prefill and decode models for one device and model.

A profile is keyed by ``(device_name, model_id, weights_hash, dtype, threads)``
(threads only on CPU; ``dtype`` names the compute precision too, :func:`profile_dtype`)
and carries everything needed to trust or audit it:
coefficients, relative residual quantiles, held-out error, the raw samples and
their hash, creation time and software versions. Its ``id`` is
``sha256:`` over its own canonical JSON with ``id`` left out, so a profile
names its content, and ``to_json``/``from_json`` round-trip bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from foundation.errors import IntegrityFailure, InvalidInput
from foundation.hashing import canonical_json, sha256_json
from latency_model.predictors import DecodePredictor, PrefillPredictor, decode_model, prefill_model
from latency_model.step_model import StepFit, StepShape, prefill_schedule

SCHEMA_VERSION = 1
SOURCES = ("fitted", "prior")
# Fields added after the first stored profiles: left out of the JSON (and so of the id) while
# empty, so profiles written before them keep their ids and bytes.
LATE_FIELDS = ("prefill_abs_quantiles_ms", "prefill_chunk_tokens", "step_model")


def profile_dtype(identity: dict[str, Any]) -> str:
    """The ``dtype`` part of a generator identity's profile key: its dtype, qualified by its
    compute precision when that is not plain (``float32`` for fp32, ``float32/bf16-tile128``
    for the local engine's tiled bf16, :mod:`generation.precision`), so prefill and decode
    are fitted per precision while fp32 profiles keep the key they always had."""
    dtype = str(identity.get("dtype") or "").replace("torch.", "")
    precision = identity.get("precision")
    return dtype if precision in (None, "", "fp32") else f"{dtype}/{precision}"


@dataclass(frozen=True)
class Profile:
    """One device + model latency profile. Times in ms, error figures as fractions.

    Build new profiles with :meth:`create` (computes ``samples_hash`` and ``id``);
    the constructor takes the stored fields as they are.
    """

    id: str
    source: str
    created_at: str
    device: str
    device_name: str
    model_id: str
    weights_hash: str
    dtype: str
    threads: int | None
    backend: str
    context_window: int | None
    prefill_model: str
    prefill_coefficients: dict[str, float]
    prefill_quantiles: dict[str, float]
    decode_model: str
    decode_coefficients: dict[str, float]
    decode_quantiles: dict[str, float]
    prefill_abs_quantiles_ms: dict[str, float] = field(default_factory=dict)
    # the engine's prefill chunk size in tokens (forms with ``needs_chunk_tokens``); None otherwise
    prefill_chunk_tokens: int | None = None
    # the mixed-step model (latency_model.step_model.StepFit.to_dict()), {} when not calibrated
    step_model: dict[str, Any] = field(default_factory=dict)
    held_out: dict[str, Any] = field(default_factory=dict)
    form_comparison: dict[str, float] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, list[list[Any]]] = field(default_factory=dict)
    samples_hash: str = ""
    software: dict[str, str] = field(default_factory=dict)
    prior: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    schema: int = SCHEMA_VERSION

    # --- construction and identity -------------------------------------------------
    @classmethod
    def create(cls, **kwargs: Any) -> Profile:
        """A new profile from its fields (without ``id``/``samples_hash``), normalised to JSON types.

        Raises:
            InvalidInput: unknown source or model name, bad coefficients, or a non-JSON value.
        """
        kwargs.pop("id", None)
        kwargs["samples_hash"] = sha256_json(kwargs.get("samples", {}))
        draft = cls(id="", **kwargs)
        body = json.loads(canonical_json(draft._body()))  # normalise to plain JSON types
        body["id"] = sha256_json(body)
        return cls.from_dict(body)

    def _body(self) -> dict[str, Any]:
        body = self.to_dict()
        body.pop("id")
        return body

    def to_dict(self) -> dict[str, Any]:
        """All fields as plain JSON types (including ``id``; empty :data:`LATE_FIELDS` left out)."""
        body = asdict(self)
        for name in LATE_FIELDS:
            if not body[name]:
                body.pop(name)
        return body

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no whitespace); ``from_json(p.to_json()) == p``."""
        return canonical_json(self.to_dict()).decode("utf-8")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        """Rebuild a profile from :meth:`to_dict` output, checking ``id`` and ``samples_hash``.

        Raises:
            InvalidInput: missing or unknown fields, unknown source or model.
            IntegrityFailure: the stored ``id`` or ``samples_hash`` does not match the content.
        """
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise InvalidInput(f"unknown profile fields: {sorted(unknown)}")
        try:
            profile = cls(**data)
        except TypeError as exc:
            raise InvalidInput(f"incomplete profile: {exc}") from exc
        profile.verify()
        return profile

    @classmethod
    def from_json(cls, text: str | bytes) -> Profile:
        """Parse :meth:`to_json` output (see :meth:`from_dict` for errors)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"profile is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise InvalidInput("profile JSON must be an object")
        return cls.from_dict(data)

    def verify(self) -> None:
        """Recompute ``samples_hash`` and ``id``, and check the models load.

        Raises:
            IntegrityFailure: a hash does not match. InvalidInput: bad source, model or coefficients.
        """
        if self.source not in SOURCES:
            raise InvalidInput(f"profile source must be one of {SOURCES}, got {self.source!r}")
        if sha256_json(self.samples) != self.samples_hash:
            raise IntegrityFailure("profile samples_hash does not match its samples", id=self.id)
        if sha256_json(self._body()) != self.id:
            raise IntegrityFailure("profile id does not match its content", id=self.id)
        _ = self.prefill_predictor, self.decode_predictor, self.step_fit

    # --- key --------------------------------------------------------------------------
    @property
    def key(self) -> tuple[str, str, str, str, int | None]:
        """``(device_name, model_id, weights_hash, dtype, threads)``; threads only on CPU."""
        return (self.device_name, self.model_id, self.weights_hash, self.dtype,
                self.threads if self.device.startswith("cpu") else None)

    # --- prediction -----------------------------------------------------------------------
    @cached_property
    def prefill_predictor(self) -> PrefillPredictor:
        """The prefill point predictor (no residual band)."""
        return prefill_model(self.prefill_model)(self.prefill_coefficients, self.prefill_chunk_tokens)

    @cached_property
    def step_fit(self) -> StepFit | None:
        """The mixed-step model (``latency_model.step_model``), or None when not calibrated."""
        return StepFit.from_dict(self.step_model) if self.step_model else None

    @cached_property
    def decode_predictor(self) -> DecodePredictor:
        """The decode point predictor (no residual band)."""
        return decode_model(self.decode_model)(self.decode_coefficients)

    def predict_ttft_many(self, prompt_tokens: ArrayLike, cached_tokens: ArrayLike,
                          prefix_tokens: ArrayLike | None = None
                          ) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Vectorised :meth:`predict_ttft_ms`: ``((N,) p50 ms, (N,) p95 ms)``.

        ``prefix_tokens``: the scaffold boundary the engine chunks at (default: the cached
        length), so ``(n, 0, prefix=P)`` is a cache miss on a ``P``-token scaffold.

        A miss runs the scaffold's own chunk(s), then exactly the steps a hit runs (same
        tokens at the same positions, attending to the same keys). With a step model
        (and the engine's chunk size) a miss is therefore predicted as the hit ``(n, P)``
        plus the step model's time for the scaffold chunks ``[c, P)``
        (:func:`latency_model.step_model.prefill_schedule`), so the saving of a hit is
        priced by the model that times single steps. The prefill forms see a miss's extra
        pass only through whole prefills, where passes and tokens move together: on the
        main job's profile (docs/latency_model.md, "What a cached scaffold saves, step by
        step") ``chunked`` put the saving at 345 ms against 403-464 ms measured, the step
        model at 406 ms. Without a step model the prefill form prices the miss (the
        ``chunked`` form reads ``prefix_tokens``; the others ignore it).
        """
        point = self.prefill_predictor.predict_ms(prompt_tokens, cached_tokens, prefix_tokens)  # (N,)
        fit, chunk = self.step_fit, self.prefill_chunk_tokens
        if fit is not None and chunk and prefix_tokens is not None:
            n = np.atleast_1d(np.asarray(prompt_tokens, dtype=np.int64))  # (N,)
            c = np.broadcast_to(np.atleast_1d(np.asarray(cached_tokens, dtype=np.int64)), n.shape)  # (N,)
            p = np.broadcast_to(np.atleast_1d(np.asarray(prefix_tokens, dtype=np.int64)), n.shape)  # (N,)
            miss = np.flatnonzero(p > c)
            if miss.size:
                point = np.array(point, dtype=np.float64)
                hit = self.prefill_predictor.predict_ms(n[miss], p[miss], p[miss])  # (M,)
                for j, i in enumerate(miss):
                    shapes = [StepShape.mixed(k, start, (), start + k == int(p[i]))
                              for k, start in prefill_schedule(int(p[i]), int(c[i]), int(p[i]), chunk)]
                    point[i] = hit[j] + float(fit.predict_point_ms(shapes).sum())
        return _band(point, self.prefill_quantiles, self.prefill_abs_quantiles_ms)

    def predict_ttft_ms(self, prompt_tokens: int, cached_tokens: int,
                        prefix_tokens: int | None = None) -> tuple[float, float]:
        """Predicted prefill time (TTFT without queueing), ``(p50 ms, p95 ms)``.

        ``p50 = point * (1 + q50)``; ``p95 = max(point * (1 + q95), point + A95, p50)``
        with ``q`` the relative residual quantiles and ``A95`` the absolute (ms) one of
        short prompts, when the profile has it. Both are non-decreasing in ``point``.

        Raises:
            InvalidInput: negative counts or ``cached_tokens > prompt_tokens``.
        """
        p50, p95 = self.predict_ttft_many([prompt_tokens], [cached_tokens],
                                          None if prefix_tokens is None else [prefix_tokens])
        return float(p50[0]), float(p95[0])

    def predict_tpot_ms(self, context_tokens: int) -> float:
        """Predicted p50 time of one decode step at ``context_tokens`` of context, in ms."""
        point = self.decode_predictor.predict_ms([context_tokens])
        return float(_band(point, self.decode_quantiles)[0][0])

    def summary(self) -> dict[str, Any]:
        """The profile without its raw samples (for lists and receipts)."""
        body = self.to_dict()
        body.pop("samples")
        return body


def _band(point: NDArray[np.float64], quantiles: dict[str, float],
          abs_quantiles_ms: dict[str, float] | None = None) -> tuple[NDArray[np.float64],
                                                                    NDArray[np.float64]]:
    floor = 1e-6  # ms; keeps a band multiplier from driving a time to zero or below
    p50 = np.maximum(point * (1.0 + quantiles.get("p50", 0.0)), floor)
    p95 = np.maximum(point * (1.0 + quantiles.get("p95", 0.0)), p50)
    if abs_quantiles_ms and "p95" in abs_quantiles_ms:
        p95 = np.maximum(p95, point + abs_quantiles_ms["p95"])
    return p50, p95
