import math
from typing import Any

import pytest

from app.metrics import AnswerMetrics
from app.settings import get_settings
from app.validation import check_budget, check_k, check_max_new_tokens, check_question
from foundation.errors import InvalidInput, TooLarge
from tests.app.answers import make_answer


def test_metrics_count_budget_misses_and_tokens():
    m = AnswerMetrics()
    m.observe(make_answer(status="ok", ttft_budget_ms=100, within_budget=False,
                          timings={"ttft_ms": 150, "tpot_ms": 20},
                          tokens={"prompt": 300, "cached": 100, "computed": 200, "output": 64}))
    m.observe(make_answer(status="cancelled", ttft_budget_ms=100, within_budget=True,
                          timings={"ttft_ms": 50},
                          tokens={"prompt": 10, "cached": 0, "computed": 10, "output": 3}))
    text = m.render().decode()
    assert "ragbudget_budget_misses_total 1.0" in text
    assert 'ragbudget_answers_total{status="cancelled"} 1.0' in text
    assert 'ragbudget_prompt_tokens_total{kind="computed"} 210.0' in text
    assert "ragbudget_ttft_ms_count 2.0" in text
    assert "ragbudget_output_tokens_total 67.0" in text


@pytest.mark.parametrize("budget", [0, -5, math.inf, math.nan, 10**9])
def test_budget_outside_range_is_rejected_with_code(budget):
    with pytest.raises(InvalidInput) as exc:
        check_budget(get_settings(), budget)
    assert exc.value.code == "invalid_budget"


def test_question_limits():
    s = get_settings(max_question_chars=10)
    assert check_question(s, "  hi ") == "hi"
    with pytest.raises(InvalidInput):
        check_question(s, " \n\t ")
    with pytest.raises(TooLarge):
        check_question(s, "x" * 11)


def test_k_and_max_new_tokens_limits():
    s = get_settings(max_k=8, max_new_tokens_limit=16)
    assert check_k(s, None, 16) == 8
    with pytest.raises(InvalidInput):
        check_k(s, 9, 4)
    assert check_max_new_tokens(s, None) == s.default_max_new_tokens
    with pytest.raises(InvalidInput):
        check_max_new_tokens(s, 17)


def _sample(text: str, name: str, engine: str) -> float:
    """The value of sample ``name{engine=...}`` in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == name and s.labels.get("engine") == engine)


def _filled_cache(budget_mib: float) -> Any:
    """A prefix cache holding scaffold blocks of 4 tokens (2 layers, 1 KV head, head dim 8)."""
    import torch

    from generation.engine.kv_cache import BlockPrefixCache

    cache = BlockPrefixCache("m@w", "cpu", "float32", chunk=4, budget_mib=budget_mib)
    for first in range(3):
        kv = {layer: (torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)) for layer in range(2)}
        cache.put([first, 1, 2, 3], kv, torch.zeros(16))
    plan = cache.plan([0, 1, 2, 3, 9, 9], 4, 4)
    cache.match(plan, 6)  # hit: the scaffold block of [0, 1, 2, 3]
    cache.match(cache.plan([7, 7, 7, 7, 9], 4, 4), 5)  # miss
    return cache


def test_prefix_cache_counters_and_memory_are_exposed_per_engine():
    cache = _filled_cache(budget_mib=1)
    cache.count_warm(64)  # tokens the engine's warm work computed
    st = cache.stats()
    assert (st.lookups, st.hits, st.cached_tokens, st.stored, st.evicted) == (2, 1, 4, 3, 0)
    m = AnswerMetrics()
    assert "ragbudget_prefix_cache_hits_total{" not in m.render().decode()  # nothing given yet
    m.prefix_cache_state({"local-a": st})
    text = m.render().decode()
    assert 'ragbudget_prefix_cache_lookups_total{engine="local-a"} 2.0' in text
    assert 'ragbudget_prefix_cache_hits_total{engine="local-a"} 1.0' in text
    assert 'ragbudget_prefix_cache_tokens_total{engine="local-a"} 4.0' in text
    assert 'ragbudget_prefix_cache_blocks_stored_total{engine="local-a"} 3.0' in text
    assert 'ragbudget_prefix_cache_warm_tokens_total{engine="local-a"} 64.0' in text
    assert 'ragbudget_prefix_cache_blocks{engine="local-a"} 3.0' in text
    assert _sample(text, "ragbudget_prefix_cache_bytes", "local-a") == st.bytes == 3 * 576
    assert _sample(text, "ragbudget_prefix_cache_budget_bytes", "local-a") == 1 << 20
    assert "# TYPE ragbudget_prefix_cache_blocks_evicted_total counter" in text


def test_prefix_cache_evictions_show_and_memory_stays_within_budget():
    # One block is 2 layers x 2 x 4 x 8 floats + 16 logits = 576 bytes; a budget of two blocks.
    cache = _filled_cache(budget_mib=2 * 576 / (1 << 20))
    st = cache.stats()
    assert st.evicted == 1 and st.blocks == 2 and st.bytes <= st.budget_bytes
    m = AnswerMetrics()
    m.prefix_cache_state({"default": st})
    assert 'ragbudget_prefix_cache_blocks_evicted_total{engine="default"} 1.0' in m.render().decode()


def test_services_report_only_loaded_generators_that_keep_a_prefix_cache(tmp_path):
    from types import SimpleNamespace

    from app.services import Services

    services = Services(get_settings(data_dir=tmp_path))
    assert services.prefix_cache_stats() == {}  # nothing built, and nothing is built by asking
    assert "generator" not in services.__dict__
    services.__dict__["generator"] = SimpleNamespace(prefix_cache=_filled_cache(budget_mib=1))
    services.__dict__["_engine_generators"] = {"remote-b": SimpleNamespace()}  # a remote server
    got = services.prefix_cache_stats()
    assert list(got) == [services.engine_ids[0]] and got[services.engine_ids[0]].hits == 1
