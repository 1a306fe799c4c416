"""Real OpenAI clients against ``/v1/chat/completions`` on loopback, real models, real pages.

The official ``openai`` client (stop, history, models, errors), LangChain's
``ChatOpenAI`` and LlamaIndex's ``OpenAILike``, each unmodified, pointed at the
live server of :mod:`tests.answer.conftest`. Greedy decoding is deterministic, so
an answer with ``stop`` is checked against the same answer without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.answer.conftest import BUDGET_MS, QUESTION, receipt_body
from tests.conftest import CASES

pytestmark = pytest.mark.slow

MAX_TOKENS = 24


def _case(name: str) -> dict[str, Any]:
    return dict(json.loads((CASES / "openai" / name).read_text()))


def _ask(client: Any, messages: list[dict[str, Any]], **kw: Any) -> Any:
    kw.setdefault("max_tokens", MAX_TOKENS)
    kw.setdefault("model", "ragbudget")
    return client.chat.completions.create(messages=messages, extra_body={"ttft_budget_ms": BUDGET_MS}, **kw)


def test_stop_ends_the_answer_before_the_first_stop_string(client, answer_services):
    case = _case("stop_sequences.json")
    whole = _ask(client, case["messages"], max_tokens=case["max_tokens"]).choices[0].message.content
    assert "." in whole, whole  # greedy: the same text comes again, this time cut at the stop
    resp = _ask(client, case["messages"], max_tokens=case["max_tokens"], stop=case["stop"])
    choice = resp.choices[0]
    assert choice.message.content == whole[:whole.index(".")]
    assert choice.finish_reason == "stop"
    body = receipt_body(answer_services, resp.model_extra["ragbudget"]["receipt_id"])
    assert body["generator"]["params"]["stop"] == ["."] and body["output"]["stop_sequence"] == "."
    streamed = _ask(client, case["messages"], max_tokens=case["max_tokens"], stop=".", stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["stop"]


def test_stopped_answer_replays_identically(client, answer_services):
    from app.answering.receipt_wiring import replay_receipt

    case = _case("stop_sequences.json")
    resp = _ask(client, case["messages"], max_tokens=case["max_tokens"], stop=case["stop"])
    report = replay_receipt(answer_services, resp.model_extra["ragbudget"]["receipt_id"], regenerate=True)
    assert report.ok, report.render()


def test_system_message_and_history_reach_the_model_and_the_receipt(client, answer_services):
    from app.answering.receipt_wiring import replay_receipt
    from app.prompting.conversation import Turn
    from app.prompting.prompt import PromptBuilder, PromptChunk, scaffold_by_hash
    from receipts.stored import stored_hits

    case = _case("system_and_history.json")
    resp = _ask(client, case["messages"], max_tokens=case["max_tokens"])
    alone = _ask(client, case["messages"][-1:], max_tokens=case["max_tokens"])
    # the scaffold is still the cached prefix with a conversation after it
    assert resp.usage.prompt_tokens_details.cached_tokens == alone.usage.prompt_tokens_details.cached_tokens
    body = receipt_body(answer_services, resp.model_extra["ragbudget"]["receipt_id"])
    assert body["request"]["messages"] == case["messages"]
    assert body["retrieval"]["query"] == "And what is its default?\nWhat does max_wal_senders control?"
    # What the model was shown (the prompt whose token-id hash the receipt records) holds the
    # system text and both earlier turns, between the scaffold and the sources.
    engine = answer_services.engine
    hits, problems = stored_hits(engine, body)
    assert not problems
    prompt = PromptBuilder.for_tokenizer(answer_services.tokenizer).build(
        scaffold_by_hash(engine, body["scaffold"]["hash"]).text,
        [PromptChunk(h.document_id, h.version, h.text) for h in hits], body["question"],
        [Turn(m["role"], m["content"]) for m in body["request"]["messages"][:-1]],
        order=body["prompt"]["layout"]["slots"])  # in the order the prompt showed them (app.prompting.layout)
    assert (prompt.prompt_hash, prompt.prompt_tokens) == (body["prompt"]["token_ids_hash"],
                                                          body["prompt"]["prompt_tokens"])
    shown = prompt.text[len(answer_services.tokenizer.decode(prompt.scaffold_ids)):]
    assert shown.index("#orca7") < shown.index("max_wal_senders control?") \
        < shown.index("concurrent WAL sender processes.") < shown.index("Question: And what is its default?")
    report = replay_receipt(answer_services, body["id"])
    assert report.ok and report.check("prompt").status == "ok", report.render()


def test_models_list_and_retrieve(client, answer_services):
    ids = [m.id for m in client.models.list()]
    assert ids[0] == "ragbudget" and len(ids) == 2
    model = client.models.retrieve(ids[1])
    assert model.id == ids[1] and model.object == "model" and model.owned_by == "ragbudget"
    weights = answer_services.generator.identity["weights_hash"]
    assert model.model_extra["ragbudget"]["weights_hash"] == weights
    resp = _ask(client, [{"role": "user", "content": QUESTION}], model=ids[1], max_tokens=4)
    assert resp.model == ids[1] and resp.choices[0].message.content


@pytest.mark.parametrize(("kw", "param", "code"), [
    ({"n": 2}, "n", "unsupported_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     "tools", "unsupported_parameter"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
    ({"logprobs": True}, "logprobs", "unsupported_parameter"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_stop"),
])
def test_refused_fields_raise_bad_request_naming_the_field(client, kw, param, code):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as err:
        _ask(client, [{"role": "user", "content": QUESTION}], **kw)
    assert (err.value.status_code, err.value.param, err.value.code) == (400, param, code)


def test_image_part_and_unknown_model_are_refused(client):
    from openai import BadRequestError, NotFoundError

    with pytest.raises(BadRequestError) as err:
        _ask(client, [{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])
    assert err.value.param == "messages[0].content[1].type"
    with pytest.raises(NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": QUESTION}])
    assert missing.value.code == "model_not_found"


@pytest.mark.parametrize(("first", "follow_up", "page"), [
    ("What does ANALYZE collect?", "Does it lock the table?", "sql-analyze.html"),
    ("How do BRIN indexes work?", "When should I use it?", "indexes-types.html"),
])
def test_a_follow_up_retrieves_its_topics_pages(client, answer_services, first, follow_up, page):
    """Alone, the follow-up names no topic and retrieval goes elsewhere; after its first question
    (sent as history, as a chat UI does) the top candidate is the topic's page."""
    alone = _ask(client, [{"role": "user", "content": follow_up}], max_tokens=1)
    within = _ask(client, [{"role": "user", "content": first},
                           {"role": "assistant", "content": "Let me explain."},
                           {"role": "user", "content": follow_up}], max_tokens=1)
    body = receipt_body(answer_services, within.model_extra["ragbudget"]["receipt_id"])
    alone_body = receipt_body(answer_services, alone.model_extra["ragbudget"]["receipt_id"])
    assert body["retrieval"]["query"] == f"{follow_up}\n{first}"
    assert body["candidates"][0]["document_id"] == page
    assert alone_body["candidates"][0]["document_id"] != page


def test_shared_jcs_check_matches_a_real_answers_receipt(client, answer_services, tmp_path):
    resp = _ask(client, [{"role": "user", "content": QUESTION}], max_tokens=4)
    body = receipt_body(answer_services, resp.model_extra["ragbudget"]["receipt_id"])
    path = tmp_path / "receipt.json"
    path.write_text(json.dumps({"receipt": body}))
    out = subprocess.run([sys.executable, str(CASES / "receipts_jcs_check.py"), str(path)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert next(line for line in out.splitlines() if line.startswith("RFC 8785")).endswith("MATCH"), out
    assert "0 integers above 2^53" in out, out


# --- LangChain ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def langchain_chat(live_server: Any) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model="ragbudget", base_url=f"{live_server.base_url}/v1",
                                       api_key="unused-auth-disabled", max_tokens=MAX_TOKENS, temperature=0,
                                       max_retries=0, timeout=120,
                                       extra_body={"ttft_budget_ms": BUDGET_MS})


def test_langchain_chat_openai_invokes_with_history_and_stop(langchain_chat, answer_services):
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    case = _case("system_and_history.json")
    kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
    messages = [kinds[m["role"]](content=m["content"]) for m in case["messages"]]
    reply = langchain_chat.invoke(messages)
    assert reply.content and reply.response_metadata["finish_reason"] in ("stop", "length")
    assert reply.usage_metadata["input_tokens"] > 0
    whole = langchain_chat.invoke(QUESTION).content
    cut = whole.split()[2]  # a word greedy decoding will write again
    stopped = langchain_chat.invoke(QUESTION, stop=[cut])
    assert stopped.content == whole[:whole.index(cut)]
    assert stopped.response_metadata["finish_reason"] == "stop"


def test_langchain_chat_openai_streams(langchain_chat):
    whole = langchain_chat.invoke(QUESTION).content
    assert "".join(chunk.content for chunk in langchain_chat.stream(QUESTION)) == whole


# --- LlamaIndex -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_index_llm(live_server: Any) -> Any:
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    return openai_like.OpenAILike(model="ragbudget", api_base=f"{live_server.base_url}/v1",
                                  api_key="unused-auth-disabled", is_chat_model=True, temperature=0.0,
                                  max_tokens=MAX_TOKENS, context_window=2048, max_retries=0, timeout=120,
                                  additional_kwargs={"extra_body": {"ttft_budget_ms": BUDGET_MS}})


def test_llama_index_openai_like_chats_and_streams(llama_index_llm):
    from llama_index.core.llms import ChatMessage

    messages = [ChatMessage(role="system", content="Answer in one sentence."),
                ChatMessage(role="user", content=QUESTION)]
    reply = llama_index_llm.chat(messages)
    assert reply.message.content
    streamed = "".join(r.delta or "" for r in llama_index_llm.stream_chat(messages))
    assert streamed == reply.message.content
    assert llama_index_llm.complete(QUESTION).text
