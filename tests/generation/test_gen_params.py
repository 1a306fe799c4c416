"""Decoding parameters: vLLM's accepted ranges, and what a receipt records of them."""

from __future__ import annotations

from typing import Any

import pytest

from foundation.errors import InvalidInput
from generation.base import MAX_SEED, GenParams

VALID_EDGES = [
    GenParams(max_new_tokens=1),
    GenParams(temperature=2.0, top_p=5e-324, seed=MAX_SEED),
    GenParams(temperature=5e-324, seed=0),
    GenParams(max_new_tokens=3, min_tokens=3, ignore_eos=True),
]
INVALID = [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.0000001}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"seed": MAX_SEED + 1}, "seed"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"max_new_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"seed": 1.0}, "seed"),
]


@pytest.mark.parametrize("params", VALID_EDGES, ids=repr)
def test_the_edges_of_every_range_are_accepted(params: GenParams) -> None:
    assert params.validate() is params


@pytest.mark.parametrize(("fields", "param"), INVALID, ids=[repr(f) for f, _ in INVALID])
def test_values_outside_vllms_ranges_are_refused_naming_the_parameter(fields: dict[str, Any],
                                                                      param: str) -> None:
    with pytest.raises(InvalidInput) as err:
        GenParams(**fields).validate()
    assert err.value.code == "invalid_sampling_parameter" and err.value.details["param"] == param
    assert param in err.value.message


def test_receipts_record_ignore_eos_and_min_tokens_only_when_set_and_read_them_back() -> None:
    plain = GenParams(max_new_tokens=5, temperature=0.5, top_p=0.9, seed=7)
    assert plain.to_dict() == {"max_new_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 7}
    used = GenParams(max_new_tokens=5, ignore_eos=True, min_tokens=2)
    assert used.to_dict()["ignore_eos"] is True and used.to_dict()["min_tokens"] == 2
    for params in (plain, used):
        assert GenParams.from_dict({**params.to_dict(), "stop": ["x"]}) == params
