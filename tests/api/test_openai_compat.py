"""What OpenAI-compatible clients need beyond the fields: the receipt's fate, the context window,
message names and legacy completions (fake model, real pipeline, in-process app).

The real clients (``openai``, LangChain, LlamaIndex) against a served app are in
:mod:`tests.api.test_openai_clients`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from receipts import chain as chain_mod
from tests.api.conftest import KeyedApp, api_settings, start_keyed_app
from tests.api.fakes import EchoGenerator

REPLY = "The pump is painted vermilion."
DOC = "The circulation pump is painted vermilion and draws 3 kW at full load."
Q = "What colour is the pump?"
#: Output tokens a request may ask for here: enough to overrun the fake model's 8192-token window.
MAX_NEW_LIMIT = 9000


@pytest.fixture(scope="module")
def compat(tmp_path_factory: pytest.TempPathFactory, api_profile: Any) -> Iterator[KeyedApp]:
    root = tmp_path_factory.mktemp("compat")
    app = start_keyed_app(api_settings(root, retrieval_candidates=2, max_new_tokens_limit=MAX_NEW_LIMIT),
                          api_profile)
    app.services.__dict__["generator"] = EchoGenerator(app.services.tokenizer, reply=REPLY)
    with app.client:
        r = app.client.post("/v1/documents", json={"id": "pump.txt", "text": DOC},
                            headers=app.headers("admin"))
        assert r.status_code == 201, r.text
        yield app
    app.services.close()


def chat(app: KeyedApp, messages: list[dict[str, Any]] | None = None, **extra: Any) -> Any:
    body = {"model": "ragbudget", "messages": messages or [{"role": "user", "content": Q}], **extra}
    return app.client.post("/v1/chat/completions", json=body, headers=app.headers("copilot"))


def data_lines(response: Any) -> list[Any]:
    """The JSON objects of a server-sent event stream (``[DONE]`` as the string)."""
    return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
            for line in response.text.splitlines() if line.startswith("data: ")]


# --- receipt_status on the OpenAI route ------------------------------------------------------
def test_chat_completion_says_its_receipt_was_written(compat: KeyedApp) -> None:
    extra = chat(compat).json()["ragbudget"]
    assert (extra["receipt_status"], extra["receipt_error"]) == ("written", None)
    final = [c for c in data_lines(chat(compat, stream=True)) if c != "[DONE]" and "ragbudget" in c]
    assert len(final) == 1 and final[0]["ragbudget"]["receipt_status"] == "written"


def test_chat_completion_says_its_receipt_is_pending_when_the_append_was_not_acknowledged(
        compat: KeyedApp, monkeypatch: pytest.MonkeyPatch) -> None:
    real = chain_mod.append_receipt

    def committed_then_dropped(*a: Any, **k: Any) -> Any:
        real(*a, **k)
        raise OperationalError("COMMIT", {}, ConnectionResetError("server closed the connection"))

    monkeypatch.setattr(chain_mod, "append_receipt", committed_then_dropped)
    extra = chat(compat).json()["ragbudget"]
    assert extra["receipt_status"] == "pending" and "server closed" in extra["receipt_error"]
    final = [c for c in data_lines(chat(compat, stream=True)) if c != "[DONE]" and "ragbudget" in c]
    assert final[0]["ragbudget"]["receipt_status"] == "pending"
