"""What the benchmark scripts share (``benchmarks/common.py``): one quantile, JSONL rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.common import append_jsonl, machine, quantile, quantile_or_none


def test_quantile_interpolates_linearly_between_ranks() -> None:
    # numpy's default (Hyndman & Fan type 7): p95 of two values lies between them, not on the larger
    assert quantile([10.0, 20.0], 0.95) == pytest.approx(19.5)
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)


def test_quantile_of_no_values_is_refused() -> None:
    with pytest.raises(ValueError, match="no values"):
        quantile([], 0.5)


def test_quantile_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        quantile([1.0], 95)


def test_quantile_or_none_is_none_for_a_cell_without_answers() -> None:
    assert quantile_or_none([], 0.95) is None
    assert quantile_or_none([3.0], 0.95) == 3.0


def test_append_jsonl_adds_one_line_per_row_to_what_is_there(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "load.jsonl"
    append_jsonl(out, [{"kind": "run"}])
    append_jsonl(out, [{"kind": "answer", "ttft_ms": 1.5}, {"kind": "answer", "ttft_ms": 2.0}])
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert rows == [{"kind": "run"}, {"kind": "answer", "ttft_ms": 1.5}, {"kind": "answer", "ttft_ms": 2.0}]


def test_machine_names_the_cpu_cores_and_load() -> None:
    m = machine()
    assert set(m) == {"cpu", "cores", "loadavg"}
    assert isinstance(m["cpu"], str) and m["cpu"] and len(m["loadavg"]) == 3
