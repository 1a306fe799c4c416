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


# --- the context window: 400 context_length_exceeded before queueing ---------------------------
WINDOW = EchoGenerator.context_window


def receipts_of(app: KeyedApp) -> int:
    from sqlalchemy import func, select

    from foundation.db import read_session
    from receipts.models import ReceiptRow

    with read_session(app.services.engine) as s:
        return int(s.scalar(select(func.count()).select_from(ReceiptRow)) or 0)


def long_history(chars: int) -> list[dict[str, Any]]:
    """A conversation of about ``chars`` character-tokens before the question."""
    return [{"role": "user", "content": "pump " * (chars // 10)},
            {"role": "assistant", "content": "noted " * (chars // 12)}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_that_do_not_fit_beside_the_prompt_are_400_context_length_exceeded(
        compat: KeyedApp, field: str, stream: bool) -> None:
    before = receipts_of(compat)
    r = chat(compat, **{field: WINDOW - 10}, stream=stream)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "context_length_exceeded",
                                                        field)
    d = err["details"]
    assert d["context_window"] == WINDOW and d["max_new_tokens"] == WINDOW - 10
    assert d["prompt_tokens"] + d["max_new_tokens"] > WINDOW
    assert f"maximum context length is {WINDOW} tokens" in err["message"]
    assert receipts_of(compat) == before  # nothing generated, nothing recorded


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_over_the_whole_window_are_context_length_exceeded_not_the_servers_cap(
        compat: KeyedApp, field: str) -> None:
    """An output limit no prompt could sit beside (here over the server's own cap too) is the
    context-window refusal clients handle, naming the field sent."""
    before = receipts_of(compat)
    r = chat(compat, **{field: MAX_NEW_LIMIT + 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", field)
    assert err["details"]["context_window"] == WINDOW
    assert err["details"]["max_new_tokens"] == MAX_NEW_LIMIT + 1
    assert "field" not in err["details"]
    assert f"maximum context length is {WINDOW} tokens" in err["message"]
    assert receipts_of(compat) == before


def test_a_conversation_longer_than_the_window_is_400_naming_messages(compat: KeyedApp) -> None:
    r = chat(compat, [*long_history(WINDOW + 500), {"role": "user", "content": Q}], max_tokens=8)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
    assert err["details"]["prompt_tokens"] >= WINDOW
    assert err["details"]["param"] == "messages" and "field" not in err["details"]


def test_max_tokens_that_just_fit_are_answered(compat: KeyedApp) -> None:
    refused = chat(compat, max_tokens=WINDOW - 10).json()["error"]["details"]
    fits = WINDOW - refused["prompt_tokens"]
    r = chat(compat, max_tokens=fits)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == REPLY


def test_without_max_tokens_the_default_is_cut_to_what_the_window_leaves(compat: KeyedApp) -> None:
    """No output limit asked for: the server's default (64) shrinks to the room left, as vLLM does."""
    from receipts.chain import get_receipt

    def prompt_tokens(n: int) -> int:  # of a conversation with an n-character earlier message
        probe = chat(compat, [{"role": "user", "content": "p" * n}, {"role": "user", "content": Q}],
                     max_tokens=WINDOW - 1)
        return int(probe.json()["error"]["details"]["prompt_tokens"])

    n = 100 + WINDOW - 20 - prompt_tokens(100)  # one character, one token: 20 tokens left
    room = WINDOW - prompt_tokens(n)
    assert room == 20 < compat.services.settings.default_max_new_tokens
    r = chat(compat, [{"role": "user", "content": "p" * n}, {"role": "user", "content": Q}])
    assert r.status_code == 200, r.text
    body = get_receipt(compat.services.engine, r.json()["ragbudget"]["receipt_id"])
    assert body["generator"]["params"]["max_new_tokens"] == room
    assert r.json()["choices"][0]["message"]["content"] == REPLY[:room]


def test_answer_route_refuses_max_new_tokens_over_the_window_with_its_own_shape(compat: KeyedApp) -> None:
    r = compat.client.post("/v1/answer", json={"question": Q, "max_new_tokens": WINDOW - 10},
                           headers=compat.headers("copilot"))
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert set(err) == {"code", "message", "details"}
    assert err["code"] == "context_length_exceeded" and err["details"]["field"] == "max_new_tokens"


# --- message names ----------------------------------------------------------------------------
NAMED = [{"role": "system", "content": "Answer briefly.", "name": "house_rules"},
         {"role": "user", "content": "Which pump?", "name": "alice"},
         {"role": "assistant", "content": "The circulation pump.", "name": "research_agent"},
         {"role": "user", "content": Q, "name": "alice"}]


def test_message_names_are_recorded_in_the_receipt_and_replay_exactly(compat: KeyedApp) -> None:
    from app.answering.receipt_wiring import replay_receipt
    from receipts.chain import get_receipt

    named = chat(compat, NAMED, max_tokens=8)
    assert named.status_code == 200, named.text
    body = get_receipt(compat.services.engine, named.json()["ragbudget"]["receipt_id"])
    assert body["request"]["messages"] == NAMED
    # The name is recorded, not shown: the model saw the same prompt as without names.
    plain = chat(compat, [{k: v for k, v in m.items() if k != "name"} for m in NAMED], max_tokens=8)
    plain_body = get_receipt(compat.services.engine, plain.json()["ragbudget"]["receipt_id"])
    assert all("name" not in m for m in plain_body["request"]["messages"])
    assert body["prompt"]["token_ids_hash"] == plain_body["prompt"]["token_ids_hash"]
    report = replay_receipt(compat.services, body["id"], regenerate=True)
    assert report.ok and report.check("prompt").status == "ok", report.render()


def test_a_null_name_is_no_name(compat: KeyedApp) -> None:
    from receipts.chain import get_receipt

    r = chat(compat, [{"role": "user", "content": Q, "name": None}], max_tokens=4)
    assert r.status_code == 200, r.text
    body = get_receipt(compat.services.engine, r.json()["ragbudget"]["receipt_id"])
    assert body["request"]["messages"] == [{"role": "user", "content": Q}]


# --- legacy completions -----------------------------------------------------------------------
def complete(app: KeyedApp, **body: Any) -> Any:
    return app.client.post("/v1/completions", json={"model": "ragbudget", "prompt": Q, **body},
                           headers=app.headers("copilot"))


def test_completions_answer_a_prompt_as_one_user_turn(compat: KeyedApp) -> None:
    from receipts.chain import get_receipt

    r = complete(compat, max_tokens=12)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "text_completion" and got["id"].startswith("cmpl-")
    assert got["choices"] == [{"index": 0, "text": REPLY[:12], "finish_reason": "length", "logprobs": None}]
    assert got["usage"]["completion_tokens"] == 12
    assert got["usage"]["total_tokens"] == got["usage"]["prompt_tokens"] + 12
    assert r.headers["X-Ragbudget-Receipt-Id"] == got["ragbudget"]["receipt_id"]
    assert got["id"] == f"cmpl-{got['ragbudget']['receipt_id']}"  # the id leads to the receipt
    body = get_receipt(compat.services.engine, got["ragbudget"]["receipt_id"])
    assert body["request"]["messages"] == [{"role": "user", "content": Q}] and body["question"] == Q
    # the same answer path as a chat with that one user message: the same prompt
    same = chat(compat, max_tokens=12).json()
    chat_body = get_receipt(compat.services.engine, same["ragbudget"]["receipt_id"])
    assert chat_body["prompt"]["token_ids_hash"] == body["prompt"]["token_ids_hash"]
    assert same["choices"][0]["message"]["content"] == got["choices"][0]["text"]


def test_completions_stream_text_chunks_then_usage(compat: KeyedApp) -> None:
    r = complete(compat, stream=True, stream_options={"include_usage": True}, stop=".")
    assert r.status_code == 200, r.text
    chunks = data_lines(r)
    assert chunks[-1] == "[DONE]"
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    body = chunks[:-2]
    assert all(c["object"] == "text_completion" for c in body)
    assert "".join(c["choices"][0]["text"] for c in body) == REPLY[:REPLY.index(".")]
    assert [c["choices"][0]["finish_reason"] for c in body if c["choices"][0]["finish_reason"]] == ["stop"]
    assert body[-1]["ragbudget"]["receipt_status"] == "written"


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({"prompt": ["one", "two"]}, "prompt", "unsupported_parameter"),
    ({"prompt": [1, 2, 3]}, "prompt", "unsupported_parameter"),
    ({"echo": True}, "echo", "unsupported_parameter"),
    ({"suffix": "end"}, "suffix", "unsupported_parameter"),
    ({"logprobs": 2}, "logprobs", "unsupported_parameter"),
    ({"best_of": 3}, "best_of", "unsupported_parameter"),
    ({"tools": []}, "tools", "unsupported_parameter"),
    ({"max_tokens": WINDOW}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "   "}, None, "empty_question"),
])
def test_completions_refuse_what_they_do_not_honour(compat: KeyedApp, extra: dict[str, Any],
                                                    param: str | None, code: str) -> None:
    before = receipts_of(compat)
    r = complete(compat, **extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["type"]) == (code, "invalid_request_error")
    if param is not None:
        assert err["param"] == param
    assert receipts_of(compat) == before


def test_completions_accept_neutral_values_and_a_list_of_one_prompt(compat: KeyedApp) -> None:
    r = complete(compat, prompt=[Q], n=1, best_of=1, echo=False, suffix=None, logprobs=None,
                 presence_penalty=0, frequency_penalty=0.0, logit_bias={}, max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == REPLY[:4]
