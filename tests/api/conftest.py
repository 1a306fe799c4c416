"""API fixtures: the real app over fake model services, with API keys for every role.

``make_services`` pre-sets the lazily built model properties of :class:`Services`
(tokenizer, embedder, generator) with fakes, so retrieval, planning, prompt
assembly, receipts and replay run for real without loading a model. A fitted
latency profile for the fake generator's identity is stored first, so the
planner never needs a CPU probe.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.api.app import create_app
from app.auth import ROLES, create_key, revoke_key
from app.profile_store import save_profile
from app.services import Services
from app.settings import Settings, get_settings
from latency_model.calibration import calibrate
from latency_model.grid import quick_grid
from latency_model.profile import Profile
from retrieval.chunking import ChunkerConfig
from retrieval.store import IngestItem, ingest_batch
from tests.api.fakes import CharTokenizer, EchoGenerator
from tests.latency_model.conftest import FakeTimer, no_cpu_probe
from tests.retrieval.fakes import HashingEmbedder

SENTINEL = "Zebrafish sentinel paragraph: the circulation pump is painted vermilion."


@pytest.fixture(scope="session")
def api_profile() -> Profile:
    """A profile fitted on the fake timer (its identity is the fake generator's)."""
    return calibrate(FakeTimer(), grid=quick_grid(8192, [200]), seed=3, progress=False,
                     cpu_probe=no_cpu_probe)


def make_services(settings: Settings, profile: Profile, generator: Any = None) -> Services:
    """:class:`Services` whose tokenizer, embedder and generator are fakes; the profile is stored."""
    services = Services(settings)
    tokenizer = CharTokenizer()
    services.__dict__["tokenizer"] = tokenizer
    services.__dict__["embedder"] = HashingEmbedder()
    services.__dict__["generator"] = generator or EchoGenerator(tokenizer)
    save_profile(services.engine, services.data_dir, profile)
    return services


def services_with_docs(settings: Settings, profile: Profile, generator: Any,
                       docs: dict[str, str]) -> Services:
    """:func:`make_services` with ``docs`` (document id -> text) ingested as one batch, chunked
    and embedded as ``settings`` say."""
    services = make_services(settings, profile, generator)
    ingest_batch(services.engine, [IngestItem(d, text=t) for d, t in docs.items()],
                 tokenizer=services.tokenizer,
                 chunker_config=ChunkerConfig(settings.chunk_tokens, settings.chunk_overlap_tokens),
                 embedder=services.embedder)
    return services


def api_settings(root: Path, **overrides: Any) -> Settings:
    """Settings for an API test: auth on, SQLite under ``root`` (overrides win)."""
    base: dict[str, Any] = {"data_dir": root / "data", "database_url": f"sqlite:///{root / 'api.db'}",
                            "auth_enabled": True}
    base.update(overrides)
    return get_settings(**base)


@dataclass
class KeyedApp:
    """A running app (TestClient) with one key per role plus a revoked admin key."""

    client: TestClient
    services: Services
    keys: dict[str, str] = field(default_factory=dict)

    def headers(self, who: str) -> dict[str, str]:
        """Headers for ``who``: a role name, ``revoked``, ``malformed``, ``unknown`` or ``none``."""
        if who == "none":
            return {}
        if who == "malformed":
            return {"Authorization": "Bearer not-a-ragbudget-key"}
        if who == "unknown":
            return {"Authorization": "Bearer rb_0123456789abcdef_" + "x" * 43}
        return {"Authorization": f"Bearer {self.keys[who]}"}


def start_keyed_app(settings: Settings, profile: Profile, generator: Any = None) -> KeyedApp:
    """Build services and keys; the caller enters ``client`` (``with app.client:``)."""
    services = make_services(settings, profile, generator)
    keys = {role: create_key(services.engine, role, f"test {role}")[1] for role in ROLES}
    revoked, keys["revoked"] = create_key(services.engine, "admin", "revoked admin")
    revoke_key(services.engine, revoked.id)
    return KeyedApp(TestClient(create_app(services=services)), services, keys)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, api_profile: Profile) -> Iterator[KeyedApp]:
    """One app per test module (auth on, default limits) holding one ingested document."""
    root = tmp_path_factory.mktemp("secured")
    app = start_keyed_app(api_settings(root), api_profile)
    with app.client:
        r = app.client.post("/v1/documents", json={"id": "pump.txt", "text": SENTINEL},
                            headers=app.headers("admin"))
        assert r.status_code == 201, r.text
        yield app
    app.services.close()
