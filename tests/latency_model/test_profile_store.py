"""Profile store: JSON files + database rows, id lookup, sync, and fitted-over-prior selection."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from app.profile_store import (
    current_profile,
    find_profile,
    key_of,
    list_profiles,
    load_profile,
    profiles_dir,
    save_profile,
)
from app.services import Services
from app.settings import Settings
from foundation.errors import InvalidInput, UnknownProfile
from latency_model.profile import Profile
from tests.latency_model.conftest import IDENTITY, FakeTimer
from tests.latency_model.test_roofline import SMOLLM2


class FakeGenerator(FakeTimer):
    """A generator as the store sees it: identity, config_dict(), and the timer methods."""

    def config_dict(self) -> dict[str, Any]:
        return dict(SMOLLM2)


@pytest.fixture
def services(settings: Settings, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Services:
    monkeypatch.setattr("latency_model.probe.probe_cpu", lambda threads: {
        "peak_flops": 1e11, "bandwidth_bytes_s": 2e10, "source": "fake probe"})
    svc = Services(settings)
    svc.__dict__["engine"] = engine
    svc.__dict__["generator"] = FakeGenerator()
    return svc


def _restamp(profile: Profile, created_at: str, **changes: Any) -> Profile:
    body = {f.name: getattr(profile, f.name) for f in dataclasses.fields(profile)}
    body.update(created_at=created_at, **changes)
    return Profile.create(**body)


def test_saved_profile_is_identical_in_file_and_database(services: Services,
                                                         fitted_profile: Profile) -> None:
    path = save_profile(services.engine, services.data_dir, fitted_profile)
    assert path.parent == profiles_dir(services.data_dir)
    assert path.read_text(encoding="utf-8") == fitted_profile.to_json()
    loaded = load_profile(services.engine, services.data_dir, fitted_profile.id)
    assert loaded == fitted_profile and loaded.to_json() == fitted_profile.to_json()


def test_saving_twice_keeps_one_profile(services: Services, fitted_profile: Profile) -> None:
    save_profile(services.engine, services.data_dir, fitted_profile)
    save_profile(services.engine, services.data_dir, fitted_profile)
    assert [p.id for p in list_profiles(services.engine, services.data_dir)] == [fitted_profile.id]


def test_profile_is_found_by_bare_hex_prefix(services: Services, fitted_profile: Profile) -> None:
    save_profile(services.engine, services.data_dir, fitted_profile)
    prefix = fitted_profile.id.removeprefix("sha256:")[:10]
    assert load_profile(services.engine, services.data_dir, prefix).id == fitted_profile.id


def test_unknown_profile_id_is_not_found(services: Services) -> None:
    with pytest.raises(UnknownProfile):
        load_profile(services.engine, services.data_dir, "sha256:" + "f" * 64)


def test_too_short_profile_id_is_invalid(services: Services) -> None:
    with pytest.raises(InvalidInput):
        load_profile(services.engine, services.data_dir, "abc")


def test_list_is_newest_first(services: Services, fitted_profile: Profile) -> None:
    older = _restamp(fitted_profile, "2020-01-01T00:00:00+00:00")
    newer = _restamp(fitted_profile, "2030-01-01T00:00:00+00:00")
    for p in (older, newer):
        save_profile(services.engine, services.data_dir, p)
    assert [p.id for p in list_profiles(services.engine, services.data_dir)] == [newer.id, older.id]


def test_file_dropped_into_the_folder_is_imported(services: Services, fitted_profile: Profile) -> None:
    folder = profiles_dir(services.data_dir)
    folder.mkdir(parents=True)
    (folder / f"{fitted_profile.id.removeprefix('sha256:')}.json").write_text(fitted_profile.to_json())
    (folder / "garbage.json").write_text("{not json")
    assert [p.id for p in list_profiles(services.engine, services.data_dir)] == [fitted_profile.id]


def test_without_a_fitted_profile_a_prior_is_built_and_saved(services: Services) -> None:
    profile = current_profile(services)
    assert profile.source == "prior" and profile.key == key_of(IDENTITY)
    assert profile.prior is not None and profile.prior["peaks_source"] == "fake probe"
    assert current_profile(services).id == profile.id
    assert [p.id for p in list_profiles(services.engine, services.data_dir)] == [profile.id]


def test_fitted_profile_wins_over_a_newer_prior(services: Services, fitted_profile: Profile) -> None:
    assert current_profile(services).source == "prior"  # built and saved now
    old_fit = _restamp(fitted_profile, "2020-01-01T00:00:00+00:00")
    save_profile(services.engine, services.data_dir, old_fit)
    assert current_profile(services).id == old_fit.id


def test_profile_for_another_thread_count_is_not_used(services: Services,
                                                      fitted_profile: Profile) -> None:
    save_profile(services.engine, services.data_dir, _restamp(fitted_profile, fitted_profile.created_at,
                                                              threads=4))
    assert find_profile(services.engine, key_of(IDENTITY), "fitted") is None
    assert current_profile(services).source == "prior"


def test_remote_engine_without_config_has_no_prior(services: Services) -> None:
    remote = FakeGenerator(identity={"backend": "remote", "model_id": "m", "device": "remote",
                                     "device_name": "remote: http://x", "weights_hash": None,
                                     "dtype": None, "threads": None, "context_window": 4096})
    remote.config_dict = lambda: {}  # type: ignore[method-assign]
    services.__dict__["generator"] = remote
    with pytest.raises(UnknownProfile):
        current_profile(services)


def test_profiles_dir_is_under_the_data_dir(tmp_path: Path) -> None:
    assert profiles_dir(tmp_path) == tmp_path / "profiles"
