"""Safe defaults: loopback bind, a bootstrap admin key on first start only, loud auth-off."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from app.api.app import create_app
from app.auth import authenticate, list_keys
from app.cli.main import build_parser
from app.cli.serve_cmds import bootstrap_admin_key, cmd_serve
from app.services import Services
from app.settings import Settings


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RAGBUDGET_* variable leaks in from the environment."""
    for name in list(os.environ):
        if name.startswith("RAGBUDGET_"):
            monkeypatch.delenv(name)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record ``uvicorn.run`` calls instead of serving."""
    import uvicorn

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append({"app": app, **kw}))
    return calls


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "--no-preload", *argv])


def secured_services(settings: Settings, engine: Engine) -> Services:
    services = Services(settings.model_copy(update={"auth_enabled": True}))
    services.__dict__["engine"] = engine
    return services


def test_default_settings_bind_loopback_with_auth_on(clean_env: None) -> None:
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    assert s.host == "127.0.0.1" and s.auth_enabled is True


def test_serve_binds_127_0_0_1_unless_told_otherwise(clean_env: None, settings: Settings, engine: Engine,
                                                     served: list[dict[str, Any]]) -> None:
    services = secured_services(settings, engine)
    assert serve_args().host is None  # no parser default that could override the setting
    cmd_serve(serve_args(), services)
    cmd_serve(serve_args("--host", "0.0.0.0", "--port", "9001"), services)
    assert [(c["host"], c["port"]) for c in served] == [("127.0.0.1", 8000), ("0.0.0.0", 9001)]


def test_first_start_creates_one_admin_key_printed_once(settings: Settings, engine: Engine,
                                                        served: list[dict[str, Any]],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    services = secured_services(settings, engine)
    cmd_serve(serve_args(), services)
    first = capsys.readouterr()
    key = next(line.strip() for line in first.err.splitlines() if line.strip().startswith("rb_"))
    assert authenticate(engine, key).role == "admin"
    assert key not in first.out
    cmd_serve(serve_args(), services)
    second = capsys.readouterr()
    assert "rb_" not in second.err + second.out
    assert [k["role"] for k in list_keys(engine)] == ["admin"]


def test_no_bootstrap_key_when_auth_is_disabled(settings: Settings, engine: Engine) -> None:
    services = Services(settings.model_copy(update={"auth_enabled": False}))
    services.__dict__["engine"] = engine
    assert bootstrap_admin_key(services) is None and list_keys(engine) == []


def test_auth_disabled_needs_the_explicit_setting(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGBUDGET_AUTH_ENABLED", "false")
    assert Settings(_env_file=None).auth_enabled is False  # type: ignore[call-arg]


def test_auth_disabled_logs_a_warning_on_every_start(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    off = Settings(_env_file=None, data_dir=tmp_path, auth_enabled=False)  # type: ignore[call-arg]
    on = off.model_copy(update={"auth_enabled": True})
    with caplog.at_level(logging.WARNING, logger="ragbudget"):
        create_app(on)
        assert not [r for r in caplog.records if "DISABLED" in r.getMessage()]
        create_app(off)
        create_app(off)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "DISABLED" in r.getMessage()]
    assert len(warnings) == 2


def test_with_auth_disabled_every_caller_is_admin(tmp_path: Any) -> None:
    off = Settings(_env_file=None, data_dir=tmp_path, auth_enabled=False)  # type: ignore[call-arg]
    with TestClient(create_app(off)) as client:
        assert client.get("/v1/keys").status_code == 200
