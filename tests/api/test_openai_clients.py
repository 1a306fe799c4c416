"""The real OpenAI clients, unmodified, against a served app (uvicorn on loopback, fake models).

What each client does when the server refuses: the official ``openai`` client, LangChain's
``ChatOpenAI`` and LlamaIndex's ``OpenAILike`` (its defaults: legacy completions) each hit the
context-window error and a 429 under load. The generator
(:class:`tests.api.fakes.StepGenerator`) holds the model on the fake timer's schedule, which
the stored profile was fitted on, so the server's predicted wait is the schedule's; the
server runs one answer at a time and lets none wait (``queue_max`` 0), so concurrent callers
get 429 ``busy`` until the model is free. docs/clients.md writes down what is shown here.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.answer.conftest import free_port
from tests.api.conftest import api_settings, start_keyed_app
from tests.api.fakes import CharTokenizer, StepGenerator

DOC = "The circulation pump is painted vermilion and draws 3 kW at full load."
Q = "What colour is the pump?"
REPLY = "The pump is painted vermilion. " * 4  # 124 characters: one token each
WINDOW = StepGenerator.context_window
#: Output tokens of a loaded answer: ~0.3 s of prefill and ~21 ms per token on the fake
#: schedule, about 2.4 s on the model, over the 2 s the server used to say in every Retry-After.
LOAD_TOKENS = 100


@dataclass
class Served:
    """The app on ``base_url`` (``/v1`` appended for clients) with a copilot key."""

    base_url: str
    key: str
    app: Any
    seen: list[tuple[int, dict[str, str]]] = field(default_factory=list)

    def http_client(self) -> httpx.Client:
        """An httpx client that records every response's status and headers in ``seen``."""
        def record(response: httpx.Response) -> None:
            self.seen.append((response.status_code, dict(response.headers)))

        return httpx.Client(timeout=120, event_hooks={"response": [record]})


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, api_profile: Any) -> Iterator[Served]:
    import uvicorn

    root = tmp_path_factory.mktemp("clients")
    gen = StepGenerator(CharTokenizer(), reply=REPLY)
    app = start_keyed_app(api_settings(root, queue_max=0, retrieval_candidates=2,
                                       max_new_tokens_limit=2 * WINDOW), api_profile, gen)
    with app.client:
        r = app.client.post("/v1/documents", json={"id": "pump.txt", "text": DOC},
                            headers=app.headers("admin"))
        assert r.status_code == 201, r.text
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app.client.app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="uvicorn-clients", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield Served(f"http://127.0.0.1:{port}", app.keys["copilot"], app.client.app)
    server.should_exit = True
    thread.join(15)
    app.services.close()


def concurrently(n: int, call: Callable[[], Any]) -> list[Any]:
    """``call()`` from ``n`` threads at once; each result, or the exception it raised."""
    results: list[Any] = [None] * n
    start = threading.Barrier(n)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = call()
        except Exception as exc:  # what the client raised is the result under test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def assert_429s_said_the_predicted_wait(served: Served) -> int:
    """Every 429 seen carried Retry-After (whole seconds, >= 1) and ``x-should-retry: true``;
    returns how many there were."""
    refusals = [h for status, h in served.seen if status == 429]
    for headers in refusals:
        assert int(headers["retry-after"]) >= 1 and headers["x-should-retry"] == "true", headers
    return len(refusals)


# --- openai -----------------------------------------------------------------------------------
def openai_client(served: Served, **kw: Any) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{served.base_url}/v1", api_key=served.key, http_client=served.http_client(),
                  **kw)


def test_openai_raises_bad_request_context_length_exceeded(served: Served) -> None:
    from openai import BadRequestError

    client = openai_client(served)
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="ragbudget", messages=[{"role": "user", "content": Q}],
                                       max_tokens=WINDOW)
    assert (err.value.status_code, err.value.code, err.value.param) == (400, "context_length_exceeded",
                                                                        "max_tokens")
    with pytest.raises(BadRequestError) as err:
        client.chat.completions.create(model="ragbudget", max_tokens=8, messages=[
            {"role": "user", "content": "pump " * (WINDOW // 5)}, {"role": "user", "content": Q}])
    assert (err.value.code, err.value.param) == ("context_length_exceeded", "messages")


def test_openai_default_retries_wait_out_a_loaded_server(served: Served) -> None:
    """Three callers at once, one model, no queue: two get 429 and retry after the Retry-After the
    server predicts (the answer ahead's time left on the model, rounded up); with the client's
    default two retries every caller is answered. (A fixed 2 s hint brought the last caller
    back while the model was still busy, and its retries ran out.)"""
    served.seen.clear()
    client = openai_client(served)  # default max_retries: 2

    def ask() -> Any:
        return client.chat.completions.create(
            model="ragbudget", messages=[{"role": "user", "content": Q}], max_tokens=LOAD_TOKENS)

    results = concurrently(3, ask)
    assert [type(r).__name__ for r in results] == ["ChatCompletion"] * 3, results
    assert all(r.choices[0].message.content == REPLY[:LOAD_TOKENS] for r in results)
    assert assert_429s_said_the_predicted_wait(served) >= 2
    first_429 = next(h for status, h in served.seen if status == 429)
    assert int(first_429["retry-after"]) > 2  # the answer ahead's time, not a fixed guess


def test_openai_does_not_retry_a_budget_no_retry_can_make(served: Served) -> None:
    from openai import InternalServerError

    served.seen.clear()
    client = openai_client(served)
    with pytest.raises(InternalServerError) as err:
        client.chat.completions.create(model="ragbudget", messages=[{"role": "user", "content": Q}],
                                       max_tokens=4, extra_body={"ttft_budget_ms": 1,
                                                                 "on_budget_miss": "reject"})
    assert err.value.status_code == 503 and err.value.code == "budget_unreachable"
    assert [(s, h.get("x-should-retry"), "retry-after" in h) for s, h in served.seen] == [
        (503, "false", False)]  # one request: the client's retries were not spent on it


def test_retry_after_is_the_predicted_wait_rounded_up(served: Served) -> None:
    """A 429's Retry-After is ``details.predicted_wait_ms`` in whole seconds, rounded up."""
    served.seen.clear()
    client = openai_client(served, max_retries=0)
    from openai import RateLimitError

    def ask() -> Any:
        return client.chat.completions.with_raw_response.create(
            model="ragbudget", messages=[{"role": "user", "content": Q}], max_tokens=LOAD_TOKENS)

    results = concurrently(2, ask)
    refused = [r for r in results if isinstance(r, RateLimitError)]
    assert len(refused) == 1, results
    wait_ms = refused[0].body["details"]["predicted_wait_ms"]
    assert refused[0].response.headers["retry-after"] == str(max(1, math.ceil(wait_ms / 1000)))
