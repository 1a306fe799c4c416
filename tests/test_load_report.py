"""The load benchmark's report arithmetic: exact binomial tails and the expected short cells."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from benchmarks.load_hog import summarise
from benchmarks.load_report import binomial_tail, short_cell_odds


def test_binomial_tail_against_closed_forms() -> None:
    assert binomial_tail(20, 0, 0.05) == pytest.approx(1.0)
    assert binomial_tail(20, 1, 0.05) == pytest.approx(1.0 - 0.95 ** 20)
    assert binomial_tail(20, 2, 0.05) == pytest.approx(1.0 - 0.95 ** 20 - 20 * 0.05 * 0.95 ** 19)
    assert binomial_tail(20, 21, 0.05) == 0.0
    assert binomial_tail(3, 3, 0.5) == pytest.approx(0.125)
    with pytest.raises(ValueError):
        binomial_tail(5, 1, 1.5)


def test_short_cells_expected_at_exactly_95_percent() -> None:
    # 20 answers a cell allow one miss; two or more leave it short: 1 - P(0) - P(1).
    per_cell = 1.0 - 0.95 ** 20 - 20 * 0.05 * 0.95 ** 19
    assert short_cell_odds([20] * 30) == pytest.approx(30 * per_cell)
    assert 7.5 < short_cell_odds([20] * 30) < 8.5
    # 19 answers allow no miss (0.95 x 19 = 18.05 within needed): short as soon as one misses.
    assert short_cell_odds([19]) == pytest.approx(1.0 - 0.95 ** 19)
    assert math.isclose(short_cell_odds([]), 0.0)


def test_refusal_line_counts_each_cell_and_its_client_time() -> None:
    from benchmarks.load_report import refusal_figures

    def row(status: int, load: str, **kw: object) -> dict[str, object]:
        return {"status": status, "load": load, "budget": 800.0, "tokens": 32, **kw}

    rows = [row(200, "closed-4", client_ms=900.0),
            row(503, "closed-4", client_ms=30.0, where="arrival", predicted_ttft_ms=812.0, retry_after_s=2.0),
            row(503, "closed-4", client_ms=50.0, where="granted", predicted_ttft_ms=870.0, retry_after_s=5.0),
            row(503, "poisson-0.3", client_ms=20.0, where="arrival", predicted_ttft_ms=804.0)]
    line = refusal_figures("on", rows)
    assert line is not None and line.startswith("on refusals: ")
    closed, poisson = line.removeprefix("on refusals: ").split("; ")
    assert closed == ("closed-4 800 ms 32 tok: 2 ({'arrival': 1, 'granted': 1}), predicted 812-870 ms, "
                      "0.08 s of client time, Retry-After 2-5 s")
    assert poisson == ("poisson-0.3 800 ms 32 tok: 1 ({'arrival': 1}), predicted 804-804 ms, "
                       "0.02 s of client time, Retry-After - s")
    assert refusal_figures("on", rows[:1]) is None  # nothing refused: no line


def test_arm_line_gives_mean_budget_used_per_budget() -> None:
    from benchmarks.load_report import arm_figures

    def row(budget: float, ttft: float) -> dict[str, object]:
        return {"status": 200, "load": "closed-1", "budget": budget, "tokens": 32, "ttft_ms": ttft,
                "within": ttft <= budget, "predicted_p95_ms": budget, "binding": "budget"}

    line = arm_figures("on", [row(800.0, 400.0), row(800.0, 600.0), row(3000.0, 2700.0)])
    assert "mean budget used by budget 800 ms 62.5 %, 3000 ms 90.0 %" in line


def test_batching_table_reports_the_key_check_of_keyed_answers() -> None:
    from benchmarks.load_report import batching_report

    cell = {"clients": 1, "arm": "batched", "within": 2, "requests": 2, "wall_s": 10.0,
            "goodput_per_min": 12.0, "answers_per_min": 12.0, "ttft_p50": 900.0, "ttft_p95": 1000.0,
            "tpot_mean": 100.0, "k_mean": 2.0,
            "rows": [{"auth_ms": 0.2}, {"auth_ms": 0.4}, {"auth_ms": None}]}
    out = batching_report([cell])
    assert "key check (auth_ms) over 2 keyed answers: median 0.30 ms, max 0.40 ms" in out
    assert "key check" not in batching_report([{**cell, "rows": [{"auth_ms": None}]}])


def test_hog_summary_gives_coverage_per_block_the_slowdown_and_k() -> None:
    def row(hog: bool, prefill: float | None, p95: float, p50: float, k: int) -> dict[str, object]:
        return {"hog": hog, "prefill_ms": prefill, "corrected_p95": p95, "answers_p95": p95 * 0.9,
                "fitted_p95": p50 * 1.1, "fitted_p50": p50, "k": k, "factor": 1.5,
                "speed": 1.7 if hog else None}

    rows = [row(False, 100.0, 120.0, 100.0, 5), row(False, 110.0, 120.0, 100.0, 4),
            row(True, 250.0, 200.0, 100.0, 3),  # answer 1 after the hog: a miss
            *[row(True, 180.0, 200.0, 100.0, 2) for _ in range(4)],  # answers 2-5: covered
            row(True, None, 200.0, 100.0, 2)]  # an answer with no measured prefill is left out
    s = summarise(rows, warmup=2)
    assert s["warmup"] == 1.0
    assert s["after_1"]["corrected"] == 0.0
    assert s["after_2_5"]["corrected"] == 1.0
    assert s["after_2_5"]["answers"] == 1.0  # 180 <= 180
    assert s["after_2_5"]["fitted"] == 0.0  # 180 > 110
    assert s["after_1_10"]["corrected"] == pytest.approx(4 / 5)
    assert s["after_11_20"] == {"corrected": None, "answers": None, "fitted": None, "speed": None,
                                "prefill_over_fitted_p50": None}
    assert s["after_2_5"]["speed"] == [1.7, 1.7]
    assert s["after_2_5"]["prefill_over_fitted_p50"] == [1.8, 1.8]
    assert s["prefill_over_fitted_p50"] == {"warmup": 1.05, "hog": 1.8}
    assert s["k"] == {"warmup": [4, 5], "hog": [2, 3]}
    assert s["factor_end"] == 1.5


def test_hog_report_recomputes_the_summary_from_a_stored_run(tmp_path: Path) -> None:
    from benchmarks.load import main

    rows = [{"hog": False, "prefill_ms": 100.0, "corrected_p95": 120.0, "answers_p95": 120.0,
             "fitted_p95": 110.0, "fitted_p50": 100.0, "k": 5, "factor": 1.0, "speed": None},
            {"hog": True, "prefill_ms": 230.0, "corrected_p95": 200.0, "answers_p95": 200.0,
             "fitted_p95": 110.0, "fitted_p50": 100.0, "k": 3, "factor": 1.0, "speed": 2.0}]
    out = tmp_path / "hog.jsonl"
    out.write_text(json.dumps({"kind": "hog", "profile": "p", "rows": rows}) + "\n", encoding="utf-8")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["--report", "--out", str(out)]) == 0
    got = json.loads(buf.getvalue())
    assert got["profile"] == "p" and got["warmup"] == 1.0
    assert got["after_1"]["corrected"] == 0.0 and got["after_1"]["speed"] == [2.0, 2.0]
    assert got["prefill_over_fitted_p50"] == {"warmup": 1.0, "hog": 2.3}
