"""Console fixtures: the :mod:`tests.ui.world` app behind a TestClient, and sign-in helpers."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from latency_model.profile import Profile
from tests.ui.world import ConsoleWorld, build_world


@pytest.fixture(scope="session")
def ui_profile() -> Profile:
    """A profile fitted on the fake timer, keyed to the fake generator (as ``tests.api``'s)."""
    from latency_model.calibration import calibrate
    from latency_model.grid import quick_grid
    from tests.latency_model.conftest import FakeTimer, no_cpu_probe

    return calibrate(FakeTimer(), grid=quick_grid(8192, [200]), seed=3, progress=False,
                     cpu_probe=no_cpu_probe)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, ui_profile: Profile) -> Iterator[ConsoleWorld]:
    """One console world per test module (SQLite, auth on)."""
    w = build_world(tmp_path_factory.mktemp("console"), ui_profile)
    yield w
    w.services.close()


def csrf_of(html: str) -> str:
    """The first CSRF token in a page's forms."""
    m = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert m, "no CSRF token in the page"
    return m.group(1)


def sign_in(client: TestClient, key: str) -> TestClient:
    """Sign ``client`` in with ``key`` through the real form; asserts the redirect."""
    page = client.get("/ui/login")
    r = client.post("/ui/login", data={"csrf_token": csrf_of(page.text), "api_key": key},
                    follow_redirects=False)
    assert r.status_code == 303, r.text
    return client


@pytest.fixture
def operator(world: ConsoleWorld) -> Iterator[TestClient]:
    """A fresh browser-like client signed in with the operator key."""
    with TestClient(world.app) as client:
        yield sign_in(client, world.keys["operator"])
