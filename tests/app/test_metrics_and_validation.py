import math

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
