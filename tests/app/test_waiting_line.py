"""One owner of the waiting line: the pipeline hands an answer to its generator while it holds
the admit lock, so an engine that queues answers when ``stream()`` is called (the local one)
shows every answer granted before the next is planned; the answer's stats come back on the
stream ``stream()`` returned, and a prompt the generator refuses ends as a failed answer with
its receipt, as a failure while streaming does.

The pipeline runs for real over fake model services (tests/api/fakes.py), so no model loads.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from app.answering.pipeline import AnswerPipeline
from app.answering.state import AnswerRequest
from app.services import Services
from foundation.errors import InvalidInput
from generation.base import TokenStream
from latency_model.calibration import calibrate
from latency_model.grid import quick_grid
from latency_model.profile import Profile
from receipts.chain import get_receipt
from tests.api.conftest import api_settings, services_with_docs
from tests.api.fakes import CharTokenizer, EchoGenerator
from tests.latency_model.conftest import FakeTimer, no_cpu_probe

DOCS = {"pump.txt": "Zebrafish sentinel paragraph: the circulation pump is painted vermilion.",
        "valve.txt": "The relief valve on the second loop is painted green."}
QUESTION = "What colour is the circulation pump?"


@pytest.fixture(scope="module")
def profile() -> Profile:
    """A profile fitted on the fake timer (the fake generator's identity), as tests/api uses."""
    return calibrate(FakeTimer(), grid=quick_grid(8192, [200]), seed=3, progress=False,
                     cpu_probe=no_cpu_probe)


class WatchedGenerator(EchoGenerator):
    """:class:`EchoGenerator` that notes, at every ``stream()`` call, whether ``lock`` was held
    and how many events the answer had yielded by then; keeps the streams it returned.
    ``refuse``: ``stream()`` raises :class:`InvalidInput` as a backend refusing the prompt."""

    def __init__(self, tokenizer: CharTokenizer, refuse: bool = False) -> None:
        super().__init__(tokenizer, reply="vermilion")
        self.refuse = refuse
        self.lock: threading.Lock | None = None
        self.yielded: list[str] = []  # the answer's event kinds, appended by the test
        self.calls: list[tuple[bool, list[str]]] = []
        self.streams: list[TokenStream] = []

    def stream(self, prompt_ids: list[int], **kwargs: Any) -> TokenStream:
        self.calls.append((self.lock is not None and self.lock.locked(), list(self.yielded)))
        if self.refuse:
            raise InvalidInput("the prompt is empty")
        stream = super().stream(prompt_ids, **kwargs)
        self.streams.append(stream)
        return stream


def services_with(root: Path, profile: Profile, gen: WatchedGenerator) -> Services:
    settings = api_settings(root, auth_enabled=False, default_max_new_tokens=6)
    return services_with_docs(settings, profile, gen, DOCS)


def test_an_answer_is_handed_to_its_generator_under_the_admit_lock_before_it_is_admitted(
        tmp_path: Path, profile: Profile) -> None:
    gen = WatchedGenerator(CharTokenizer())
    services = services_with(tmp_path, profile, gen)
    try:
        pipe = AnswerPipeline(services)
        gen.lock = pipe.bands.admit_lock
        events = []
        for ev in pipe.stream(AnswerRequest(question=QUESTION, ttft_budget_ms=5000)):
            gen.yielded.append(ev.kind)
            events.append(ev)
    finally:
        services.close()
    # started once, with the admit lock held, before the admitted event went out
    assert gen.calls == [(True, [])]
    assert [e.kind for e in events][0] == "admitted" and events[-1].kind == "final"
    final = events[-1].summary
    assert final is not None and final.status == "ok" and final.text == "vermilion"[:6]
    # the answer's stats are its own stream's
    stats = gen.streams[0].stats
    assert stats is not None and stats.output_tokens == final.tokens.output == 6
    assert stats.prompt_tokens == final.tokens.prompt


def test_a_prompt_the_generator_refuses_ends_as_a_failed_answer_with_its_receipt(
        tmp_path: Path, profile: Profile) -> None:
    gen = WatchedGenerator(CharTokenizer(), refuse=True)
    services = services_with(tmp_path, profile, gen)
    try:
        pipe = AnswerPipeline(services)
        gen.lock = pipe.bands.admit_lock
        answer = pipe.answer(AnswerRequest(question=QUESTION, ttft_budget_ms=5000))
        assert answer.receipt_id is not None
        body = get_receipt(services.engine, answer.receipt_id)
    finally:
        services.close()
    assert gen.calls == [(True, [])]
    assert answer.status == "failed" and answer.error is not None
    assert answer.error.code == "invalid_input" and "the prompt is empty" in answer.error.message
    assert answer.tokens.output == 0 and answer.text == ""
    assert body is not None and body["status"] == "failed"
