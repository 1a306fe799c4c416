"""``ragbudget calibrate`` / ``profiles`` and ``GET /v1/latency/profiles`` with a fake generator."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from app.api.app import create_app
from app.auth import create_key
from app.profile_store import save_profile
from app.services import Services
from app.settings import Settings, get_settings
from latency_model.profile import Profile
from tests.conftest import run_cli
from tests.latency_model.test_profile_store import FakeGenerator


@pytest.fixture
def fake_env(engine: Engine, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> FakeGenerator:
    """Every Services built in this test uses one fake generator and the database under test."""
    fake = FakeGenerator()
    monkeypatch.setattr(Services, "generator", property(lambda self: fake))
    monkeypatch.setenv("RAGBUDGET_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("RAGBUDGET_DATABASE_URL", settings.resolved_database_url)
    return fake


_run = run_cli


def test_calibrate_quick_json_fits_and_saves_a_profile(fake_env: FakeGenerator, settings: Settings,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "calibrate", "--quick", "--json", "--no-progress",
                        "--cached-tokens", "200")
    data = json.loads(out)
    assert code == 0 and data["source"] == "fitted" and "samples" not in data
    assert data["calibration"]["name"] == "quick" and data["calibration"]["cached_tokens"] == [0, 200]
    assert data["saved_to"].startswith(str(settings.data_dir))
    assert {c[0] for c in fake_env.calls} == {"prefill", "decode"}


def test_calibrate_without_scaffold_sizes_measures_cached_zero(fake_env: FakeGenerator,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "calibrate", "--quick", "--json", "--no-progress", "--no-save")
    data = json.loads(out)
    assert code == 0 and data["calibration"]["cached_tokens"] == [0] and data["saved_to"] is None
    assert "scaffold sizes unavailable" in err


def test_profiles_list_and_show(fake_env: FakeGenerator, engine: Engine, settings: Settings,
                                fitted_profile: Profile, capsys: pytest.CaptureFixture[str]) -> None:
    save_profile(engine, settings.data_dir, fitted_profile)
    code, out, _ = _run(capsys, "profiles", "list", "--json")
    assert code == 0 and [p["id"] for p in json.loads(out)] == [fitted_profile.id]
    code, out, _ = _run(capsys, "profiles", "show", fitted_profile.id[7:20], "--json")
    shown = json.loads(out)
    # The online correction rides beside the fitted profile, never inside it; none is stored
    # before the first answer.
    assert code == 0 and shown.pop("correction") is None
    assert Profile.from_dict(shown) == fitted_profile
    code, out, _ = _run(capsys, "profiles", "show", fitted_profile.id)
    assert code == 0 and "source: fitted" in out and "leave-one-length-out" in out


def test_profiles_show_unknown_id_exits_not_found(fake_env: FakeGenerator,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "profiles", "show", "deadbeefdeadbeef", "--json")
    assert code == 3 and json.loads(out)["error"]["code"] == "unknown_profile"


def test_profiles_list_when_empty_says_how_to_calibrate(fake_env: FakeGenerator,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "profiles", "list")
    assert code == 0 and "ragbudget calibrate" in out


@pytest.fixture
def client(fake_env: FakeGenerator, engine: Engine, settings: Settings,
           fitted_profile: Profile) -> Iterator[tuple[TestClient, str]]:
    save_profile(engine, settings.data_dir, fitted_profile)
    conf = get_settings(data_dir=settings.data_dir, database_url=settings.resolved_database_url,
                        auth_enabled=True)
    _, key = create_key(engine, "copilot", "latency test")
    with TestClient(create_app(conf)) as c:
        yield c, key


def test_api_lists_profiles_without_samples(client: tuple[TestClient, str], fitted_profile: Profile) -> None:
    c, key = client
    r = c.get("/v1/latency/profiles", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    [p] = r.json()["profiles"]
    assert p["id"] == fitted_profile.id and p["source"] == "fitted" and "samples" not in p
    assert p["schema"] == 1


def test_api_returns_one_complete_profile(client: tuple[TestClient, str], fitted_profile: Profile) -> None:
    c, key = client
    r = c.get(f"/v1/latency/profiles/{fitted_profile.id}", headers={"Authorization": f"Bearer {key}"})
    shown = r.json()
    # The server's online correction rides beside the fitted profile: neutral before any answer.
    correction = shown.pop("correction")
    assert r.status_code == 200 and correction["n"] == 0 and correction["factor"] == 1.0
    assert {g: v["answers"] for g, v in correction["groups"].items()} == {"alone": 0, "batched": 0}
    assert Profile.from_dict(shown) == fitted_profile
    r = c.get(f"/v1/latency/profiles/{fitted_profile.id}?samples=false",
              headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200 and "samples" not in r.json()


def test_api_unknown_profile_is_404(client: tuple[TestClient, str]) -> None:
    c, key = client
    r = c.get("/v1/latency/profiles/" + "ab" * 32, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_profile"


def test_api_requires_a_key(client: tuple[TestClient, str]) -> None:
    c, _ = client
    assert c.get("/v1/latency/profiles").status_code == 401


@pytest.fixture(scope="module")
def step_profile() -> Profile:
    """A profile with a mixed-step model and a ``chunked`` prefill form (fake step timer)."""
    from latency_model.calibration import calibrate
    from latency_model.grid import quick_grid
    from tests.latency_model.conftest import no_cpu_probe
    from tests.latency_model.test_step_model import FakeStepTimer

    return calibrate(FakeStepTimer(noise=0.01), grid=quick_grid(2048, [83], 256), seed=5,
                     progress=False, cpu_probe=no_cpu_probe)


def test_a_step_model_is_shown_by_the_cli_and_returned_whole_by_the_api(
        fake_env: FakeGenerator, engine: Engine, settings: Settings, step_profile: Profile,
        capsys: pytest.CaptureFixture[str]) -> None:
    fit = step_profile.step_fit
    assert fit is not None and step_profile.step_model
    save_profile(engine, settings.data_dir, step_profile)
    code, out, _ = _run(capsys, "profiles", "show", step_profile.id)
    step_lines = [line for line in out.splitlines() if line.lstrip().startswith("step ")]
    assert code == 0 and len(step_lines) == 2
    assert "mixed_step" in step_lines[0] and f"b={fit.coefficients['b']:.4g}" in step_lines[0]
    assert f"of {fit.fresh_points}" in step_lines[1] and "leave-one-point-out" in step_lines[1]
    conf = get_settings(data_dir=settings.data_dir, database_url=settings.resolved_database_url,
                        auth_enabled=False)
    with TestClient(create_app(conf)) as c:
        r = c.get(f"/v1/latency/profiles/{step_profile.id}?samples=false")
        listed = c.get("/v1/latency/profiles").json()["profiles"]
    body = r.json()
    assert r.status_code == 200 and body["step_model"] == step_profile.step_model
    assert body["prefill_chunk_tokens"] == step_profile.prefill_chunk_tokens
    assert [p["step_model"] for p in listed] == [step_profile.step_model]
