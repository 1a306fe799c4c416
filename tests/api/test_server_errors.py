"""A server misconfiguration found while serving a request is the server's 500, not the caller's 4xx.

The app here is configured with an empty chat-template file (``chat_template``), which
is only read when the first answer needs the prompt builder: the request itself is
valid, so the answer is HTTP 500 with code ``invalid_config`` (OpenAI's ``server_error``
type on the chat route), never the 422/400 of bad input.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import SENTINEL, KeyedApp, api_settings, start_keyed_app

Q = "What colour is the pump?"


@pytest.fixture(scope="module")
def misconfigured(tmp_path_factory: pytest.TempPathFactory, api_profile: Any) -> Iterator[KeyedApp]:
    root = tmp_path_factory.mktemp("misconfigured")
    template = Path(root) / "empty.jinja"
    template.write_text("", encoding="utf-8")
    app = start_keyed_app(api_settings(root, chat_template=str(template)), api_profile)
    with app.client:
        r = app.client.post("/v1/documents", json={"id": "pump.txt", "text": SENTINEL},
                            headers=app.headers("admin"))
        assert r.status_code == 201, r.text
        yield app
    app.services.close()


def test_an_answer_that_meets_a_bad_setting_is_500_invalid_config(misconfigured: KeyedApp) -> None:
    r = misconfigured.client.post("/v1/answer", json={"question": Q, "ttft_budget_ms": 60000},
                                  headers=misconfigured.headers("copilot"))
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_config" and "empty" in error["message"]


def test_the_chat_route_answers_it_as_an_openai_server_error(misconfigured: KeyedApp) -> None:
    r = misconfigured.client.post("/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": Q}]},
                                  headers=misconfigured.headers("copilot"))
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_config" and error["type"] == "server_error"
