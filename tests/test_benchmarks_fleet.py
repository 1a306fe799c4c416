"""The fleet benchmark's bookkeeping (``benchmarks/fleet.py``): the k sweep and the comparison at
equal adherence, on hand-made rows (the benchmark itself needs real llama.cpp servers)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from benchmarks.fleet import compare, parse_ks, summarise


def _rows(arm: str, k: int | None, budget: float, outcomes: list[tuple[int | None, bool]],
          minutes: float = 1.0) -> list[dict[str, Any]]:
    """One row per (k answered with, within budget); k None: refused fast."""
    rows = []
    for got_k, within in outcomes:
        refused = got_k is None
        rows.append({"phase": "arms", "arm": arm, "fixed_k": k, "budget_ms": budget,
                     "status": "budget_unreachable" if refused else "ok", "engine": None if refused else "a",
                     "k": got_k, "within": within, "ttft_ms": None if refused else 1000.0,
                     "pred_p50_ms": None if refused else 800.0, "pred_p95_ms": None if refused else 1200.0,
                     "run_minutes": minutes})
    return rows


def test_parse_ks_sorts_and_dedups() -> None:
    assert parse_ks("3,0,1,1") == [0, 1, 3]


@pytest.mark.parametrize("text", ["", "a,1", "-1,2"])
def test_parse_ks_refuses_what_is_not_a_list_of_k(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_ks(text)


def test_summary_keeps_one_cell_per_baseline_k_and_counts_refusals_as_misses_of_requests() -> None:
    rows = (_rows("rr", 0, 3000.0, [(0, True)] * 4) + _rows("rr", 2, 3000.0, [(2, True), (2, False)])
            + _rows("joint", None, 3000.0, [(1, True), (2, True), (None, False), (3, True)]))
    s = summarise(rows)
    assert set(s) == {"rr@k0@3000", "rr@k2@3000", "joint@3000"}
    assert s["rr@k2@3000"]["within_budget"] == 0.5
    joint = s["joint@3000"]
    assert joint["within_budget"] == 1.0 and joint["within_budget_of_requests"] == 0.75
    assert joint["mean_k"] == 2.0 and joint["refused_fast"] == 0.25
    assert joint["pred_p95_cover"] == 1.0 and joint["ttft_over_pred_p50"] == pytest.approx(1.25)


def test_compare_takes_each_baselines_largest_adherent_k() -> None:
    rows = (_rows("rr", 0, 1500.0, [(0, True)] * 20) + _rows("rr", 1, 1500.0, [(1, True)] * 19 + [(1, False)])
            + _rows("rr", 2, 1500.0, [(2, True)] * 18 + [(2, False)] * 2)
            + _rows("least", 0, 1500.0, [(0, True)] * 20) + _rows("least", 1, 1500.0, [(1, False)] * 20)
            + _rows("joint", None, 1500.0, [(1, True)] * 10 + [(2, True)] * 10))
    entry = compare(summarise(rows))["1500"]
    assert entry["rr"]["adherent_k"] == 1 and entry["least"]["adherent_k"] == 0
    assert entry["joint"]["mean_k"] == 1.5
    assert entry["goal_met"] is True


def test_compare_says_the_goal_is_missed_when_a_baseline_carries_as_much_context() -> None:
    rows = (_rows("rr", 1, 1500.0, [(1, True)] * 20)
            + _rows("joint", None, 1500.0, [(1, True)] * 10 + [(0, True)] * 10))
    assert compare(summarise(rows))["1500"]["goal_met"] is False


def test_a_baseline_with_no_adherent_k_is_beaten_on_adherence() -> None:
    rows = (_rows("rr", 1, 1500.0, [(1, False)] * 20)
            + _rows("joint", None, 1500.0, [(0, True)] * 19 + [(None, False)]))
    entry = compare(summarise(rows))["1500"]
    assert entry["rr"]["adherent_k"] is None and entry["least"]["swept_k"] == []
    assert entry["goal_met"] is True and entry["goal_met_counting_refusals"] is True
