"""``POST /v1/chat/completions`` honours or refuses every OpenAI field (fake model, real pipeline).

Refusals are 400 in OpenAI's error shape with ``param`` naming the field; honoured
fields change the answer, the prompt or the receipt, and the receipt shows it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import func, select

from app.answering.receipt_wiring import replay_receipt
from foundation.db import read_session
from receipts.chain import get_receipt
from receipts.models import ReceiptRow
from tests.api.conftest import KeyedApp, api_settings, start_keyed_app
from tests.api.fakes import EchoGenerator
from tests.conftest import CASES
from tests.retrieval.fakes import HashingEmbedder

REPLY = "First rotate the log. Then compress it.\n\nDone."
DOCS = {"pump.txt": "The circulation pump is painted vermilion and draws 3 kW at full load.",
        "wal.txt": "max_wal_senders sets the maximum number of concurrent WAL sender processes. "
                   "The default max_wal_senders is 10.",
        "vacuum.txt": "Autovacuum removes dead tuples; autovacuum_naptime sets the delay between runs."}
Q = "What colour is the pump?"


@pytest.fixture(scope="module")
def chat_app(tmp_path_factory: pytest.TempPathFactory, api_profile: Any) -> Iterator[KeyedApp]:
    root = tmp_path_factory.mktemp("chat")
    settings = api_settings(root, retrieval_candidates=3)
    app = start_keyed_app(settings, api_profile)
    app.services.__dict__["generator"] = EchoGenerator(app.services.tokenizer, reply=REPLY)
    # wide enough that word-hash collisions do not decide which of three short documents ranks first
    app.services.__dict__["embedder"] = HashingEmbedder(dim=1024)
    with app.client:
        for doc_id, text in DOCS.items():
            r = app.client.post("/v1/documents", json={"id": doc_id, "text": text},
                                headers=app.headers("admin"))
            assert r.status_code == 201, r.text
        yield app
    app.services.close()


def post(app: KeyedApp, body: dict[str, Any]) -> Any:
    return app.client.post("/v1/chat/completions", json={"model": "ragbudget", **body},
                           headers=app.headers("copilot"))


def ask(app: KeyedApp, content: Any = Q, **extra: Any) -> Any:
    return post(app, {"messages": [{"role": "user", "content": content}], **extra})


def receipt_of(app: KeyedApp, response: Any) -> dict[str, Any]:
    return get_receipt(app.services.engine, response.json()["ragbudget"]["receipt_id"])


def receipt_count(app: KeyedApp) -> int:
    with read_session(app.services.engine) as s:
        return int(s.scalar(select(func.count()).select_from(ReceiptRow)) or 0)


def sse_chunks(response: Any) -> list[Any]:
    return [json.loads(line[6:]) if line[6:] != "[DONE]" else "[DONE]"
            for line in response.text.splitlines() if line.startswith("data: ")]


# --- refused, in OpenAI's error shape -------------------------------------------------------
REFUSED = [
    ({"n": 2}, "n"),
    ({"n": 0}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"store": True}, "store"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"bogus_field": 1}, "bogus_field"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"seed": 2**53}, "seed"),
    ({"temperature": 2.5}, "temperature"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_tokens"),
]


@pytest.mark.parametrize(("extra", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_unsupported_field_is_refused_with_400_naming_it(chat_app: KeyedApp, extra: dict[str, Any],
                                                         param: str) -> None:
    before = receipt_count(chat_app)
    r = ask(chat_app, **extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert err["code"]
    assert receipt_count(chat_app) == before  # refused before anything ran: no receipt


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_over_the_servers_cap_name_the_field_sent(chat_app: KeyedApp, field: str) -> None:
    """Within the window but over ``max_new_tokens_limit`` (1024): the cap's own code, with the
    client's field as ``param`` and in the message (not the pipeline's ``max_new_tokens``)."""
    r = ask(chat_app, **{field: 2000})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_max_new_tokens", field)
    assert err["details"]["limit"] == 1024
    assert err["message"].startswith(f"{field} must be in [1, 1024]")
    assert "max_new_tokens" not in err["message"]


SAMPLING_REFUSED = [({"temperature": 5}, "temperature", 5), ({"temperature": -1}, "temperature", -1),
                    ({"top_p": 2}, "top_p", 2), ({"top_p": 0}, "top_p", 0), ({"seed": -1}, "seed", -1),
                    ({"seed": True}, "seed", True), ({"min_tokens": -1}, "min_tokens", -1),
                    ({"ignore_eos": "yes"}, "ignore_eos", "yes")]


@pytest.mark.parametrize(("extra", "param", "value"), SAMPLING_REFUSED,
                         ids=[p + repr(v) for _, p, v in SAMPLING_REFUSED])
def test_a_sampling_parameter_out_of_range_or_type_is_invalid_sampling_parameter(
        chat_app: KeyedApp, extra: dict[str, Any], param: str, value: Any) -> None:
    """The schema's check of a sampling field answers the code docs/errors.md gives for it, as
    GenParams.validate does for the faults only it can see (min_tokens over max_tokens)."""
    before = receipt_count(chat_app)
    r = ask(chat_app, **extra)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_sampling_parameter", param)
    assert (err["details"]["param"], err["details"]["value"]) == (param, value)
    if param in ("temperature", "top_p", "seed"):  # the fields /v1/answer has
        r = post_answer(chat_app, {"question": Q, **extra})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "invalid_sampling_parameter"
        assert r.json()["error"]["details"]["param"] == param
    assert receipt_count(chat_app) == before


def test_a_non_finite_sampling_value_is_refused_with_a_json_body(chat_app: KeyedApp) -> None:
    body = '{"model": "ragbudget", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    r = chat_app.client.post("/v1/chat/completions", content=body,
                             headers={**chat_app.headers("copilot"), "content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_sampling_parameter" and err["details"]["value"] == "nan"


def test_a_bad_budget_names_its_field(chat_app: KeyedApp) -> None:
    r = ask(chat_app, ttft_budget_ms=-5)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_budget", "ttft_budget_ms")


def post_answer(app: KeyedApp, body: dict[str, Any]) -> Any:
    return app.client.post("/v1/answer", json=body, headers=app.headers("copilot"))


MESSAGES_REFUSED = [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
     "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                   {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
     "messages[0].content[1].type"),
    ([{"role": "tool", "content": "42", "tool_call_id": "c1"}, {"role": "user", "content": Q}],
     "messages[0].role"),
    ([{"role": "wizard", "content": "abracadabra"}, {"role": "user", "content": Q}], "messages[0].role"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                            "function": {"name": "f", "arguments": "{}"}}]},
      {"role": "user", "content": Q}], "messages[0].tool_calls"),
    ([{"role": "user", "content": Q, "name": ""}], "messages[0].name"),
    ([{"role": "user", "content": Q, "name": 7}], "messages[0].name"),
    ([{"role": "user", "content": Q, "name": "a" * 65}], "messages[0].name"),
    ([{"role": "user", "content": Q}, {"role": "assistant", "content": "prefill"}], "messages[1].role"),
]


@pytest.mark.parametrize(("messages", "param"), MESSAGES_REFUSED, ids=[p for _, p in MESSAGES_REFUSED])
def test_unsupported_message_is_refused_with_400_naming_it(chat_app: KeyedApp, messages: list[Any],
                                                           param: str) -> None:
    r = post(chat_app, {"messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_is_404_in_openai_shape(chat_app: KeyedApp) -> None:
    r = post(chat_app, {"model": "gpt-4o", "messages": [{"role": "user", "content": Q}]})
    assert r.status_code == 404
    assert r.json()["error"] | {"message": "", "details": {}} == {
        "message": "", "type": "invalid_request_error", "param": "model", "code": "model_not_found",
        "details": {}}


def test_request_errors_on_the_chat_route_are_400_with_param(chat_app: KeyedApp) -> None:
    r = ask(chat_app, "   ")
    assert (r.status_code, r.json()["error"]["code"]) == (400, "empty_question")
    r = ask(chat_app, stream="yes")
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


# --- accepted with the value that changes nothing -------------------------------------------
@pytest.mark.parametrize("extra", [{"n": 1}, {"presence_penalty": 0}, {"frequency_penalty": 0.0},
                                   {"logprobs": False}, {"response_format": {"type": "text"}},
                                   {"tool_choice": "none"}, {"tools": []}, {"logit_bias": {}},
                                   {"parallel_tool_calls": None}, {"modalities": ["text"]}])
def test_a_neutral_value_of_an_unsupported_field_is_accepted(chat_app: KeyedApp, extra: dict) -> None:
    assert ask(chat_app, max_tokens=3, **extra).status_code == 200


# --- honoured ----------------------------------------------------------------------------------
def test_stop_ends_the_answer_before_the_stop_string_with_finish_reason_stop(chat_app: KeyedApp) -> None:
    case = json.loads((CASES / "openai" / "stop_sequences.json").read_text())
    case["model"] = "ragbudget"
    r = post(chat_app, case)
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "First rotate the log"
    assert choice["finish_reason"] == "stop"
    body = receipt_of(chat_app, r)
    assert body["generator"]["params"]["stop"] == ["."]
    assert body["output"]["finish_reason"] == "stop" and body["output"]["stop_sequence"] == "."
    assert body["output"]["text"] == "First rotate the log"
    assert body["output"]["output_tokens"] == len("First rotate the log.")  # the token with the stop


def test_stop_as_a_string_spanning_tokens_and_in_a_stream(chat_app: KeyedApp) -> None:
    r = ask(chat_app, stop="\n\n", stream=True)
    chunks = [c for c in sse_chunks(r) if c != "[DONE]"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "First rotate the log. Then compress it."
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


def test_without_a_stop_hit_finish_reason_is_length_at_max_tokens(chat_app: KeyedApp) -> None:
    r = ask(chat_app, stop=["zzz"], max_tokens=5)
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("First", "length")
    assert r.json()["usage"]["completion_tokens"] == 5


def test_max_completion_tokens_is_honoured_like_max_tokens(chat_app: KeyedApp) -> None:
    r = ask(chat_app, max_completion_tokens=4)
    assert r.json()["choices"][0]["message"]["content"] == "Firs"


def test_replay_regenerates_the_same_stopped_answer(chat_app: KeyedApp) -> None:
    r = ask(chat_app, stop=[". Then"])
    assert r.json()["choices"][0]["message"]["content"] == "First rotate the log"
    report = replay_receipt(chat_app.services, r.json()["ragbudget"]["receipt_id"], regenerate=True)
    assert report.ok and report.check("regenerate").status == "ok", report.render()
    assert report.check("prompt").status == "ok"


def test_sampling_fields_and_user_are_recorded(chat_app: KeyedApp) -> None:
    r = ask(chat_app, temperature=0.7, top_p=0.9, seed=2**53 - 1, user="alice@example", max_tokens=3)
    body = receipt_of(chat_app, r)
    assert body["generator"]["params"] | {"stop": None} == {"max_new_tokens": 3, "temperature": 0.7,
                                                          "top_p": 0.9, "seed": 2**53 - 1, "stop": None}
    assert body["request"]["user"] == "alice@example"


def test_content_as_a_list_of_text_parts_is_one_question(chat_app: KeyedApp) -> None:
    r = ask(chat_app, [{"type": "text", "text": "What colour"}, {"type": "text", "text": "is the pump?"}])
    body = receipt_of(chat_app, r)
    assert body["question"] == "What colour\nis the pump?"
    assert body["request"]["messages"] == [{"role": "user", "content": "What colour\nis the pump?"}]


def test_system_message_and_earlier_turns_reach_the_prompt_and_the_receipt(chat_app: KeyedApp) -> None:
    case = json.loads((CASES / "openai" / "system_and_history.json").read_text())
    case["model"] = "ragbudget"
    alone = post(chat_app, {"model": "ragbudget", "max_tokens": 32,
                            "messages": [case["messages"][-1]]})
    r = post(chat_app, case)
    assert r.status_code == 200, r.text
    body = receipt_of(chat_app, r)
    assert body["request"]["messages"] == case["messages"]
    assert r.json()["usage"]["prompt_tokens"] > alone.json()["usage"]["prompt_tokens"] + len("ORCA-7")
    # the cached scaffold is still the prompt's prefix
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        alone.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert body["retrieval"]["query"] == "And what is its default?\nWhat does max_wal_senders control?"
    report = replay_receipt(chat_app.services, body["id"], regenerate=True)
    assert report.ok, report.render()


def test_a_follow_up_retrieves_the_pages_of_its_topic(chat_app: KeyedApp) -> None:
    history = [{"role": "user", "content": "What does max_wal_senders control?"},
               {"role": "assistant", "content": "It limits concurrent WAL sender processes."}]
    follow_up = {"role": "user", "content": "And what is its default?"}
    alone = post(chat_app, {"messages": [follow_up]}).json()["ragbudget"]["citations"]
    within = post(chat_app, {"messages": [*history, follow_up]}).json()["ragbudget"]["citations"]
    assert within[0]["document_id"] == "wal.txt"
    assert alone[0]["document_id"] != "wal.txt"  # the follow-up alone names no topic


def test_stream_with_include_usage_ends_with_a_usage_chunk(chat_app: KeyedApp) -> None:
    chunks = sse_chunks(ask(chat_app, stream=True, stream_options={"include_usage": True}, max_tokens=4))
    assert chunks[-1] == "[DONE]"
    usage = chunks[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


def test_models_list_and_get_describe_the_generator(chat_app: KeyedApp) -> None:
    h = chat_app.headers("copilot")
    listed = chat_app.client.get("/v1/models", headers=h).json()
    assert listed["object"] == "list"
    assert [m["id"] for m in listed["data"]] == ["ragbudget", "fake/model-135m"]
    one = chat_app.client.get("/v1/models/fake/model-135m", headers=h).json()
    assert one["object"] == "model" and one["ragbudget"]["weights_hash"] == "sha256:" + "ab" * 32
    assert one["ragbudget"]["context_window"] == 8192
    missing = chat_app.client.get("/v1/models/gpt-4o", headers=h)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert chat_app.client.get("/v1/models").status_code == 401
    r = post(chat_app, {"model": "fake/model-135m", "messages": [{"role": "user", "content": Q}]})
    assert r.status_code == 200 and r.json()["model"] == "fake/model-135m"
