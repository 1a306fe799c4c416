"""Fuzzing every operation of the OpenAPI schema with schemathesis against the app on fake services,
on SQLite and on PostgreSQL (whose driver refuses values SQLite stores: NUL, out-of-range numbers).

Auth is on and every request carries an admin key, so generated requests reach
the handlers. Bounded: a few examples per operation, no per-example deadline
(the machine is shared), no coverage or stateful phase. Every response must be
below 500 and match the documented schema (status code, content type, body).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import positive_data_acceptance
from schemathesis.generation import GenerationMode

from app.api.app import create_app
from app.auth import create_key
from tests.api.conftest import SENTINEL, api_settings, make_services
from tests.api.test_role_matrix import ROUTE_ROLES

# Deterministic in the suite (derandomized, 12 examples per operation and mode); a deeper,
# random exploration: RAGBUDGET_FUZZ_EXAMPLES=200 python -m pytest tests/api/test_fuzz.py
EXAMPLES_PER_OPERATION = int(os.environ.get("RAGBUDGET_FUZZ_EXAMPLES", "12"))
DERANDOMIZE = "RAGBUDGET_FUZZ_EXAMPLES" not in os.environ
# Schema-valid requests may still be refused with a 4xx and a code: the limits are configured
# at run time (question length, k, budget range) and some rules are not expressible in JSON
# Schema (a whitespace-only question, an unknown revision). The 4xx body is still checked.
EXCLUDED_CHECKS = [positive_data_acceptance]
UNDOCUMENTED = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
# OpenAPI writes a ``{name:path}`` parameter as ``{name}``. The console's HTML pages (``/ui``) are
# not part of the OpenAPI document; tests/ui covers them.
OPERATIONS = sorted((m, p.replace(":path}", "}")) for m, p in ROUTE_ROLES
                    if p not in UNDOCUMENTED and not p.startswith("/ui"))


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fuzz_db(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The fuzzed app's database: a SQLite file, or a fresh PostgreSQL schema (dropped after)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('fuzzdb') / 'api.db'}"
        return
    from sqlalchemy import create_engine, text

    from tests.conftest import PG_BASE, _pg_available

    if not _pg_available():
        if os.environ.get("RAGBUDGET_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"PostgreSQL is required but unreachable at {PG_BASE}")
        pytest.skip("PostgreSQL not reachable")
    schema = "fuzz_" + uuid.uuid4().hex[:12]
    admin = create_engine(PG_BASE, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{PG_BASE}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory: pytest.TempPathFactory, api_profile: Any,
                fuzz_db: str) -> Iterator[tuple[Any, str]]:
    services = make_services(api_settings(tmp_path_factory.mktemp("fuzz"), database_url=fuzz_db),
                             api_profile)
    _, key = create_key(services.engine, "admin", "fuzz")
    app = create_app(services=services)
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        r = client.post("/v1/documents", json={"id": "pump.txt", "text": SENTINEL},
                        headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 201
    yield app, key
    services.close()


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_target: tuple[Any, str]) -> Any:
    app, _key = fuzz_target
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_every_documented_operation_is_fuzzed(fuzz_schema: Any) -> None:
    documented = {(op.ok().method.upper(), op.ok().path) for op in fuzz_schema.get_all_operations()}
    assert documented == set(OPERATIONS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_fuzzed_requests_never_fail_on_the_server_and_match_the_schema(
        fuzz_schema: Any, fuzz_target: tuple[Any, str], method: str, path: str, mode: GenerationMode) -> None:
    _app, key = fuzz_target
    operation = fuzz_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
              derandomize=DERANDOMIZE, suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        case.call_and_validate(headers={"Authorization": f"Bearer {key}"}, excluded_checks=EXCLUDED_CHECKS)

    try:
        run()
    except Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise
        pytest.skip(f"{method} {path}: every input its schema admits is valid; nothing to negate")
