"""``k_max`` has one contract everywhere: an integer in [1, max_k]. The schema's minimum, the
check's range and its message agree (0 was advertised by the schema but refused by retrieval)."""

from __future__ import annotations

import pytest

from app.settings import get_settings
from app.validation import check_k
from foundation.errors import InvalidInput

Q = "what colour is the pump"


def test_schema_and_check_agree_on_the_minimum(secured):
    spec = secured.client.get("/openapi.json").json()
    mins = []
    for path, ops in spec["paths"].items():
        for op in ops.values():
            for p in op.get("parameters", []):
                if p["name"] == "k_max":
                    mins.append((path, p["schema"].get("anyOf", [p["schema"]])[0].get("minimum")))
    for name, schema in spec["components"]["schemas"].items():
        prop = schema.get("properties", {}).get("k_max")
        if prop is not None:
            mins.append((name, prop.get("anyOf", [prop])[0].get("minimum")))
    assert mins and all(m == 1 for _, m in mins), mins
    with pytest.raises(InvalidInput, match=r"\[1, "):
        check_k(get_settings(), 0, 4)
    assert check_k(get_settings(), 1, 4) == 1


@pytest.mark.parametrize("path", ["/v1/answer", "/v1/advise"])
def test_k_max_0_is_refused_by_the_schema_and_1_is_accepted(secured, path):
    h = secured.headers("admin")
    r = secured.client.post(path, headers=h, json={"question": Q, "ttft_budget_ms": 5000, "k_max": 0,
                                                   "stream": False} if path == "/v1/answer"
                            else {"question": Q, "ttft_budget_ms": 5000, "k_max": 0})
    assert r.status_code == 422 and "k_max" in r.json()["error"]["message"], r.text
    body = {"question": Q, "ttft_budget_ms": 5000, "k_max": 1}
    if path == "/v1/answer":
        body["stream"] = False
    r = secured.client.post(path, headers=h, json=body)
    assert r.status_code == 200, r.text
