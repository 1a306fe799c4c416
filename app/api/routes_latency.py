"""``GET /v1/latency/profiles`` and ``GET /v1/latency/profiles/{id}``: stored latency profiles.

Read-only and open to every role (``copilot`` and up): a copilot may want to
know which profile its plans come from and how good it is. Calibration changes
what every later answer sees, so it stays a CLI action (``ragbudget calibrate``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from app.api.deps import get_services, require_role
from app.services import Services

router = APIRouter(prefix="/v1/latency", tags=["latency"])


class ProfilePublic(BaseModel):
    """A profile without its raw samples. Times in ms, errors as fractions."""

    model_config = ConfigDict(populate_by_name=True)

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
    prefill_abs_quantiles_ms: dict[str, float] = Field(default_factory=dict)
    prefill_chunk_tokens: int | None = Field(
        default=None, description="prefill chunk size (tokens) of the `chunked` form; null for other forms")
    step_model: dict[str, Any] = Field(
        default_factory=dict,
        description="the mixed-step model (latency_model.step_model): form, formula, coefficients (ms per "
                    "feature unit), held-out quantiles and errors (fractions); {} when not calibrated")
    decode_model: str
    decode_coefficients: dict[str, float]
    decode_quantiles: dict[str, float]
    held_out: dict[str, Any]
    form_comparison: dict[str, float | None]
    calibration: dict[str, Any]
    samples_hash: str
    software: dict[str, str]
    prior: dict[str, Any] | None
    notes: list[str]
    schema_: int = Field(alias="schema", description="profile schema version")


class ProfileList(BaseModel):
    """Every stored profile, newest first."""

    profiles: list[ProfilePublic]


class ProfileDetail(ProfilePublic):
    """One profile, with its raw calibration samples unless they were left out.

    ``samples``: ``{"prefill": [[prompt_tokens, cached_tokens, ms], ...], "decode": [...]}``
    as recorded by calibration (see :class:`latency_model.profile.Profile`).
    """

    samples: dict[str, list[list[Any]]] | None = None
    correction: dict[str, Any] | None = Field(
        None, description="the online correction this server applies on top of the fitted "
        "coefficients (which it never rewrites): factor, p95_multiplier, n answers of window, active, "
        "coverage, speed (the machine speed from engine steps the factor is scaled to) "
        "(latency_model.correction.CorrectionState), and groups: per group of plans (alone, "
        "batched) its answers, factor, p95_multiplier and whether its own answers set them "
        "(OnlineCorrection.groups); reset by a new calibration")


def _public(summary: dict[str, Any]) -> ProfilePublic:
    return ProfilePublic.model_validate(summary)


@router.get("/profiles", response_model=ProfileList,
            dependencies=[Depends(require_role("copilot"))])
def list_latency_profiles(services: Services = Depends(get_services)) -> ProfileList:
    """Every stored profile (fitted and prior), newest first, without raw samples."""
    from app.profile_store import list_profiles

    return ProfileList(profiles=[_public(p.summary())
                                 for p in list_profiles(services.engine, services.data_dir)])


@router.get("/profiles/{profile_id}", dependencies=[Depends(require_role("copilot"))],
            response_model=ProfileDetail, response_model_exclude_unset=True)
def get_latency_profile(profile_id: str, request: Request, samples: bool = Query(
        True, description="include the raw calibration samples"),
        services: Services = Depends(get_services)) -> ProfileDetail:
    """One profile, complete (raw samples included unless ``samples=false``), with ``correction``:
    the online correction this server applies to it now.

    ``profile_id``: ``sha256:<hex>``, the bare hex, or a unique prefix of >= 8 hex digits.
    404 ``unknown_profile`` when absent; 422 for a malformed or ambiguous id.
    """
    from app.profile_store import load_profile

    profile = load_profile(services.engine, services.data_dir, profile_id)
    out = ProfileDetail.model_validate(profile.to_dict() if samples else profile.summary())
    pipeline = getattr(request.app.state, "pipeline", None)
    if pipeline is not None:
        # the correction of the engine planning with this profile (each engine has its own)
        out.correction = pipeline.bands_of(profile.id).correction_summary(profile)
    return out
