import math

import numpy as np
import pytest

from foundation.errors import InvalidInput
from ragbudget_testing.synthetic_receipts import body, sections
from receipts.schema import FORMAT_VERSION, build_receipt_body, cited_candidates


def test_built_body_carries_the_format_version():
    assert body()["format_version"] == FORMAT_VERSION


def test_missing_section_is_rejected_with_its_name():
    s = sections()
    del s["prompt"]
    with pytest.raises(InvalidInput) as err:
        build_receipt_body(**s)
    assert err.value.details["field"] == "prompt"


def test_missing_field_inside_a_section_is_named():
    s = sections()
    del s["generator"]["params"]["seed"]
    with pytest.raises(InvalidInput, match="generator.params is missing seed"):
        build_receipt_body(**s)


def test_nan_score_is_rejected():
    s = sections()
    s["candidates"][0]["score"] = math.nan
    with pytest.raises(InvalidInput, match="finite"):
        build_receipt_body(**s)


def test_bool_is_not_accepted_as_an_integer():
    s = sections()
    s["plan"]["chosen_k"] = True
    with pytest.raises(InvalidInput, match="plan.chosen_k must be int"):
        build_receipt_body(**s)


def test_unknown_status_is_rejected():
    with pytest.raises(InvalidInput, match="status"):
        build_receipt_body(**sections(status="done"))


def test_unknown_profile_source_is_rejected():
    s = sections()
    s["plan"]["profile_source"] = "guess"
    with pytest.raises(InvalidInput, match="profile_source"):
        build_receipt_body(**s)


def test_unknown_top_level_section_is_rejected():
    with pytest.raises(InvalidInput, match="unknown receipt sections"):
        build_receipt_body(**sections(), surprise=1)


def test_chain_fields_cannot_be_set_by_the_caller():
    with pytest.raises(InvalidInput, match="chain fields"):
        build_receipt_body(**sections(), prev_hash="sha256:" + "0" * 64)


def test_failed_answer_may_leave_later_sections_null():
    s = sections(status="failed")
    for name in ("plan", "scaffold", "prompt", "generator", "timings", "output"):
        s[name] = None
    s["error"] = {"code": "backend_error", "message": "model crashed"}
    assert build_receipt_body(**s)["status"] == "failed"


def test_ok_answer_may_not_leave_sections_null():
    s = sections()
    s["output"] = None
    with pytest.raises(InvalidInput, match="output must be an object"):
        build_receipt_body(**s)


def test_numpy_scores_become_plain_floats_with_the_same_value():
    s = sections()
    score = np.float32(0.123456789)
    s["candidates"][0]["score"] = score
    built = build_receipt_body(**s)
    assert type(built["candidates"][0]["score"]) is float
    assert built["candidates"][0]["score"] == float(score)


def test_cited_candidates_are_the_first_chosen_k():
    b = body(chosen_k=2)
    assert [c["rank"] for c in cited_candidates(b)] == [1, 2]
