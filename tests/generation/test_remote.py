"""The remote backend against a fake OpenAI-compatible SSE server on loopback."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from foundation.errors import BackendError
from foundation.hashing import sha256_ints
from generation.base import GenParams
from generation.remote import RemoteGenerator, iter_sse_data
from generation.remote_tokenizer import load_tiktoken
from tests.conftest import CASES
from tests.generation.fake_openai import FakeOpenAI

PIECES = ["The pump", " is", " inspected", " monthly", "."]


@pytest.fixture(scope="module")
def tiktok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tiktoken("cl100k_base", tmp_path_factory.mktemp("data"))


def make(server: FakeOpenAI, tok: Any, **kw: Any) -> RemoteGenerator:
    return RemoteGenerator(server.base_url, "fake-model", tokenizer=tok, **kw)


def test_completions_mode_sends_token_ids_and_streams_text(tiktok: Any) -> None:
    with FakeOpenAI(PIECES) as server:
        gen = make(server, tiktok)
        answer = gen.stream([1, 2, 3], cached_prefix_ids=None, params=GenParams(max_new_tokens=5))
        events = list(answer)
    assert "".join(e.text for e in events) == "The pump is inspected monthly."
    path, body = server.requests[-1]
    assert path == "/v1/completions" and body["prompt"] == [1, 2, 3] and body["max_tokens"] == 5
    assert gen.identity["mode"] == "completions"
    stats = answer.stats
    assert stats is not None and stats.finish_reason == "length"
    assert stats.output_token_ids == tiktok.encode("The pump is inspected monthly.")


def test_context_window_comes_from_the_servers_max_model_len(tiktok: Any) -> None:
    with FakeOpenAI(PIECES, max_model_len=1234) as server:
        assert make(server, tiktok).context_window == 1234


def test_chat_only_server_gets_the_prompt_messages(tiktok: Any) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    with FakeOpenAI(PIECES, token_ids=False) as server:
        gen = make(server, tiktok)
        text = "".join(e.text for e in gen.stream([5, 6], cached_prefix_ids=None,
                                                   params=GenParams(), messages=messages))
    assert text == "The pump is inspected monthly."
    path, body = server.requests[-1]
    assert path == "/v1/chat/completions" and body["messages"] == messages


def test_ttft_ignores_role_only_empty_and_usage_chunks(tiktok: Any) -> None:
    with FakeOpenAI(["", "Hello", " world"], token_ids=False) as server:
        gen = make(server, tiktok)
        answer = gen.stream([5], cached_prefix_ids=None, params=GenParams())
        events = list(answer)
    assert [e.text for e in events] == ["Hello", " world"]
    stats = answer.stats
    assert stats is not None and stats.first_text_t == events[0].t and stats.last_token_t == events[-1].t
    assert stats.prefill_ms > 0 and stats.usage == {"prompt_tokens": 10, "completion_tokens": 3}


def test_stream_without_done_yields_what_arrived_then_raises(tiktok: Any) -> None:
    raw = (CASES / "sse_truncated_no_done.txt").read_bytes()
    with FakeOpenAI([], token_ids=False, raw_stream=raw) as server:
        gen = make(server, tiktok)
        got: list[str] = []
        with pytest.raises(BackendError, match=r"\[DONE\]"):
            answer = gen.stream([5], cached_prefix_ids=None, params=GenParams())
            for ev in answer:
                got.append(ev.text)
    assert got == ["The maintenance interval", " is"]
    assert answer.stats is not None and answer.stats.finish_reason == "error"


def test_cancel_stops_reading_within_one_chunk(tiktok: Any) -> None:
    cancel = threading.Event()
    with FakeOpenAI([f" t{i}" for i in range(50)], delay_s=0.01) as server:
        gen = make(server, tiktok)
        seen = 0
        answer = gen.stream([1], cached_prefix_ids=None, params=GenParams(max_new_tokens=50), cancel=cancel)
        for _ in answer:
            seen += 1
            if seen == 3:
                cancel.set()
    assert seen == 3
    assert answer.stats is not None and answer.stats.finish_reason == "cancelled"


def test_http_error_is_a_backend_error(tiktok: Any) -> None:
    with FakeOpenAI(PIECES) as server:
        gen = RemoteGenerator(server.base_url.replace("/v1", "/nope"), "fake-model", tokenizer=tiktok,
                              mode="completions")
        answer = gen.stream([1], cached_prefix_ids=None, params=GenParams())
        with pytest.raises(BackendError, match="HTTP 404"):
            list(answer)
    assert answer.stats is not None and answer.stats.finish_reason == "error"


def test_sampling_sends_the_recorded_seed(tiktok: Any) -> None:
    with FakeOpenAI(PIECES) as server:
        gen = make(server, tiktok)
        answer = gen.stream([1], cached_prefix_ids=None, params=GenParams(temperature=0.7, top_p=0.9))
        list(answer)
    body = server.requests[-1][1]
    assert answer.stats is not None and answer.stats.params is not None
    assert isinstance(body["seed"], int) and body["seed"] == answer.stats.params.seed


def test_server_reported_cached_tokens_are_recorded(tiktok: Any) -> None:
    with FakeOpenAI(PIECES, cached_tokens=2) as server:
        gen = make(server, tiktok)
        answer = gen.stream([1, 2, 3], cached_prefix_ids=[1, 2], params=GenParams())
        list(answer)
        assert gen.prefix_cached([1, 2]) and not gen.prefix_cached([1, 2, 3])
    stats = answer.stats
    assert stats is not None and (stats.cached_tokens, stats.computed_tokens) == (2, 1)


def test_calibration_timers_measure_client_side(tiktok: Any) -> None:
    with FakeOpenAI(PIECES, delay_s=0.005) as server:
        gen = make(server, tiktok)
        prefill = gen.prefill_ms(40, 20)
        step = gen.decode_step_ms(30)
        prompts = [b["prompt"] for p, b in server.requests if b.get("stream")]
    assert prefill > 0 and step > 0
    assert len(prompts[0]) == 20 and len(prompts[1]) == 40 and prompts[1][:20] == prompts[0]


def test_sse_parser_joins_multiline_data_and_drops_an_unfinished_event() -> None:
    lines = [": comment", "data: a", "data: b", "", "event: x", "data: c", "", "data: partial"]
    assert list(iter_sse_data(lines)) == ["a\nb", "c"]


def test_tiktoken_keeps_special_token_text_plain(tmp_path: Path) -> None:
    tok = load_tiktoken("gpt-4o", tmp_path)
    ids = tok.encode("a <|endoftext|> b")
    assert tok.decode(ids) == "a <|endoftext|> b"
    assert 199999 not in ids and tok.encode_control("<|endoftext|>") == [199999]


def test_text_only_server_gets_the_decoded_prompt_less_the_bos_it_adds(tiktok: Any) -> None:
    bos = tiktok.encode("!")[0]
    ids = [bos, *tiktok.encode("Scaffold.\n\nQuestion: why?")]
    with FakeOpenAI(PIECES, tokenize=tiktok.encode, bos_id=bos) as server:
        gen = make(server, tiktok)
        gen._text.bos_id = bos
        text = "".join(e.text for e in gen.stream(ids, cached_prefix_ids=None, params=GenParams()))
    assert text == "The pump is inspected monthly." and gen.identity["mode"] == "text"
    path, body = server.requests[-1]
    assert path == "/v1/completions" and body["prompt"] == "Scaffold.\n\nQuestion: why?"
    assert [p for p, _ in server.requests].count("/extras/tokenize") == 2  # probe + this prompt


def test_text_only_server_that_splits_plain_text_differently_answers_and_reports_its_ids(
        tiktok: Any) -> None:
    ids = tiktok.encode("one\n") + tiktok.encode("\n\ntwo")  # segment-wise, as the prompt builder does
    whole = tiktok.encode("one\n\n\ntwo")
    assert ids != whole
    with FakeOpenAI(PIECES, tokenize=tiktok.encode) as server:
        gen = make(server, tiktok)
        answer = gen.stream(ids, cached_prefix_ids=None, params=GenParams())
        text = "".join(e.text for e in answer)
    assert text == "The pump is inspected monthly."
    first = next(i for i, (a, b) in enumerate(zip(ids, whole, strict=False)) if a != b)
    assert answer.stats is not None
    assert answer.stats.engine_prompt == {"prompt_tokens": len(whole), "token_ids_hash": sha256_ints(whole),
                                          "first_difference": first}


def test_text_only_server_that_reads_document_text_as_control_tokens_is_refused(tiktok: Any) -> None:
    ids = tiktok.encode("a document says <|endoftext|> here")  # plain text in ragbudget's ids
    with FakeOpenAI(PIECES, tokenize=tiktok.encode_control) as server:
        gen = make(server, tiktok)
        with pytest.raises(BackendError) as err:
            list(gen.stream(ids, cached_prefix_ids=None, params=GenParams()))
    assert err.value.code == "prompt_mismatch" and err.value.details["first_difference"] == 3
    assert server.requests[-1][0] == "/extras/tokenize"


def test_end_of_turn_ids_are_sent_as_stop_token_ids(tiktok: Any) -> None:
    with FakeOpenAI(PIECES) as server:
        gen = make(server, tiktok, stop_token_ids=[7, 3])
        list(gen.stream([1, 2], cached_prefix_ids=None, params=GenParams()))
    assert server.requests[-1][1]["stop_token_ids"] == [3, 7] and gen.eos_token_ids == [3, 7]


def test_ignore_eos_and_min_tokens_are_sent_as_vllm_request_fields(tiktok: Any) -> None:
    """vLLM's ``ignore_eos`` and ``min_tokens`` reach the server; with ``ignore_eos`` the
    end-of-turn ids are not sent as stop ids (vLLM would still stop at them); unset, neither
    field is sent, so a plain OpenAI server never sees them."""
    with FakeOpenAI(PIECES) as server:
        gen = make(server, tiktok, stop_token_ids=[7])
        list(gen.stream([1, 2], cached_prefix_ids=None,
                        params=GenParams(max_new_tokens=5, ignore_eos=True, min_tokens=3)))
        list(gen.stream([1, 2], cached_prefix_ids=None, params=GenParams(max_new_tokens=5)))
    (_, set_body), (_, plain) = server.requests[-2], server.requests[-1]
    assert set_body["ignore_eos"] is True and set_body["min_tokens"] == 3
    assert "stop_token_ids" not in set_body
    assert "ignore_eos" not in plain and "min_tokens" not in plain and plain["stop_token_ids"] == [7]


def test_parameters_outside_their_ranges_are_refused_before_any_request(tiktok: Any) -> None:
    from foundation.errors import InvalidInput

    with FakeOpenAI(PIECES) as server:
        gen = make(server, tiktok, mode="completions")
        with pytest.raises(InvalidInput) as err:
            gen.stream([1, 2], cached_prefix_ids=None, params=GenParams(max_new_tokens=2, min_tokens=3))
        assert server.requests == []
    assert err.value.code == "invalid_sampling_parameter" and err.value.details["param"] == "min_tokens"
