"""What LLM benchmark clients (guidellm, aiperf) send by default is understood, as vLLM does.

``GET /health`` (and ``/v1/health``) answers as vLLM's does, and the request extensions they
send are honoured: ``stream_options.continuous_usage_stats`` puts usage on every chunk,
``ignore_eos`` and ``min_tokens`` reach the generator and the receipt (fake model, real
pipeline; the engines' handling of them is tested in tests/generation).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from generation.base import GenParams
from tests.api.conftest import KeyedApp, api_settings, start_keyed_app
from tests.api.fakes import EchoGenerator

REPLY = "The pump is painted vermilion and draws three kilowatts."
Q = "What colour is the pump?"


class RecordingGenerator(EchoGenerator):
    """:class:`EchoGenerator` that keeps the decoding parameters of each answer it streams."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[GenParams] = []

    def stream(self, prompt_ids: list[int], **kwargs: Any) -> Any:
        self.seen.append(kwargs["params"])
        return super().stream(prompt_ids, **kwargs)


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, api_profile: Any) -> Iterator[KeyedApp]:
    root = tmp_path_factory.mktemp("bench-clients")
    keyed = start_keyed_app(api_settings(root), api_profile)
    keyed.services.__dict__["generator"] = RecordingGenerator(keyed.services.tokenizer, reply=REPLY)
    with keyed.client:
        r = keyed.client.post("/v1/documents", json={"id": "pump.txt", "text": REPLY},
                              headers=keyed.headers("admin"))
        assert r.status_code == 201, r.text
        yield keyed
    keyed.services.close()


def chunks_of(r: Any) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE response, ``[DONE]`` last and left out."""
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def chat(app: KeyedApp, **extra: Any) -> Any:
    body = {"model": "ragbudget", "messages": [{"role": "user", "content": Q}], **extra}
    return app.client.post("/v1/chat/completions", json=body, headers=app.headers("copilot"))


# --- the health probe -----------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/health", "/v1/health"])
def test_health_answers_200_with_an_empty_body_without_a_key_as_vllm(app: KeyedApp, path: str) -> None:
    r = app.client.get(path)
    assert r.status_code == 200 and r.content == b""


@pytest.mark.parametrize("path", ["/health", "/v1/health", "/healthz"])
def test_health_answers_503_when_the_database_does_not(app: KeyedApp, path: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def away(*_a: Any, **_k: Any) -> Any:
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    monkeypatch.setattr(app.services.engine, "connect", away)
    r = app.client.get(path)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"]


# --- stream_options.continuous_usage_stats --------------------------------------------------
def test_continuous_usage_stats_puts_running_usage_on_every_chunk(app: KeyedApp) -> None:
    r = chat(app, stream=True, max_tokens=5,
             stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert r.status_code == 200, r.text
    chunks = chunks_of(r)
    assert all("usage" in c for c in chunks)
    final_usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and final_usage["completion_tokens"] == 5
    prompt = final_usage["prompt_tokens"]
    assert prompt > 0
    running = [c["usage"] for c in chunks[:-1]]
    assert all(u["prompt_tokens"] == prompt for u in running)
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in running)
    completion = [u["completion_tokens"] for u in running]
    assert completion[0] == 0  # the role chunk, before any token
    assert completion == sorted(completion) and completion[-1] == 5
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert [c["usage"]["completion_tokens"] for c in content] == [1, 2, 3, 4, 5]  # one token each


def test_continuous_usage_stats_without_include_usage_adds_no_usage_as_vllm(app: KeyedApp) -> None:
    r = chat(app, stream=True, max_tokens=3, stream_options={"continuous_usage_stats": True})
    assert r.status_code == 200, r.text
    assert not any("usage" in c for c in chunks_of(r))


def test_an_unknown_stream_option_is_still_refused(app: KeyedApp) -> None:
    r = chat(app, stream=True, stream_options={"include_usage": True, "include_obfuscation": True})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options.include_obfuscation"


# --- ignore_eos and min_tokens --------------------------------------------------------------
def receipt_params(app: KeyedApp, receipt_id: str) -> dict[str, Any]:
    r = app.client.get(f"/v1/receipts/{receipt_id}", headers=app.headers("operator"))
    assert r.status_code == 200, r.text
    return r.json()["receipt"]["generator"]["params"]  # type: ignore[no-any-return]


def test_ignore_eos_and_min_tokens_reach_the_generator_and_the_receipt(app: KeyedApp) -> None:
    r = chat(app, max_tokens=6, ignore_eos=True, min_tokens=4)
    assert r.status_code == 200, r.text
    used = app.services.generator.seen[-1]
    assert (used.ignore_eos, used.min_tokens, used.max_new_tokens) == (True, 4, 6)
    params = receipt_params(app, r.headers["X-Ragbudget-Receipt-Id"])
    assert params["ignore_eos"] is True and params["min_tokens"] == 4


def test_without_them_the_receipt_reads_as_before(app: KeyedApp) -> None:
    r = chat(app, max_tokens=3)
    assert r.status_code == 200, r.text
    params = receipt_params(app, r.headers["X-Ragbudget-Receipt-Id"])
    assert "ignore_eos" not in params and "min_tokens" not in params


@pytest.mark.parametrize(("extra", "param"), [
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"min_tokens": "3"}, "min_tokens"),
])
def test_bad_ignore_eos_or_min_tokens_is_refused_naming_it(app: KeyedApp, extra: dict[str, Any],
                                                           param: str) -> None:
    r = chat(app, **extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# --- the bodies the tools send by default ---------------------------------------------------
def test_guidellm_0_8_default_chat_body_is_answered_with_usage_on_every_chunk(app: KeyedApp) -> None:
    # guidellm 0.8.1, backends/openai/request_handlers.py ChatCompletionsRequestHandler.format
    r = chat(app, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
             max_completion_tokens=8, stop=None, ignore_eos=True)
    assert r.status_code == 200, r.text
    chunks = chunks_of(r)
    assert all("usage" in c for c in chunks) and chunks[-1]["usage"]["completion_tokens"] == 8
    assert app.services.generator.seen[-1].ignore_eos is True


def test_aiperf_0_13_default_chat_body_is_answered(app: KeyedApp) -> None:
    # aiperf 0.13.0, endpoints/openai_chat.py ChatEndpoint.format_payload (streaming)
    r = chat(app, stream=True, max_completion_tokens=4, stream_options={"include_usage": True})
    assert r.status_code == 200, r.text
    chunks = chunks_of(r)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
