"""The KV-reuse benchmark's workload (``benchmarks/kv_reuse.py``), without models: seeded Zipf
topics, the share of follow-up turns and what a follow-up continues; and its table from rows."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from benchmarks.kv_reuse import FOLLOW_UPS, report, workload, zipf_weights

TOPICS = [f"topic {i}" for i in range(30)]


def test_zipf_weights_sum_to_one_and_fall_as_rank_to_the_minus_s() -> None:
    w = zipf_weights(30, 1.1)
    assert math.isclose(sum(w), 1.0)
    assert all(a > b for a, b in zip(w, w[1:], strict=False))
    assert math.isclose(w[0] / w[1], 2 ** 1.1) and math.isclose(w[0] / w[9], 10 ** 1.1)
    with pytest.raises(ValueError):
        zipf_weights(0)


def test_the_workload_is_a_pure_function_of_its_seed() -> None:
    assert workload(TOPICS, 40, 2, seed=3) == workload(TOPICS, 40, 2, seed=3)
    assert workload(TOPICS, 40, 2, seed=3) != workload(TOPICS, 40, 2, seed=4)


@pytest.mark.parametrize("clients", [1, 2, 4])
def test_thirty_percent_of_turns_are_follow_ups_of_their_clients_conversation(clients: int) -> None:
    lanes = workload(TOPICS, 40, clients, seed=0, follow_share=0.3)
    turns = [t for lane in lanes for t in lane]
    assert len(turns) == 40 and [len(lane) for lane in lanes] == [40 // clients] * clients
    assert sum(t.follow_up for t in turns) == 12  # round(0.3 * 40)
    for lane in lanes:
        assert not lane[0].follow_up  # a client's first turn opens a conversation
        for before, turn in zip(lane, lane[1:], strict=False):
            if turn.follow_up:  # same topic as the turn it follows, a question naming none
                assert turn.topic == before.topic and turn.question in FOLLOW_UPS
            else:
                assert turn.question == TOPICS[turn.topic]


def test_new_topics_follow_the_zipf_law_over_many_draws() -> None:
    lanes = workload(TOPICS, 20_000, 1, seed=1, follow_share=0.0)
    counts = Counter(t.topic for t in lanes[0])
    w = zipf_weights(len(TOPICS), 1.1)
    for rank in (0, 1, 4, 29):  # within 5 standard errors of the law's share
        p = w[rank]
        assert abs(counts[rank] / 20_000 - p) < 5 * math.sqrt(p * (1 - p) / 20_000)
    assert counts[0] > counts[1] > counts[4] > counts[29]


def test_the_table_compares_the_arms_per_cell() -> None:
    def row(arm: str, mode: str, ttft: float, k: int, within: bool, follow: bool = False) -> dict:
        return {"kind": "answer", "status": 200, "arm": arm, "clients": 1, "mode": mode, "ttft_ms": ttft,
                "k": k, "within": within, "cached_tokens": 83, "follow_up": follow,
                "predicted_new_only_ms": 100.0, "cache_bytes": 5 << 20, "prompt_tokens": 900,
                "conversation": {"layout": "earlier_turn", "receipt_id": "r", "prefix_tokens": 700}}
    rows = [{"kind": "kv-run"}, row("A", "fixed-k", 1000, 4, True), row("B", "fixed-k", 400, 4, True),
            row("A", "budget-1200", 900, 2, True), row("B", "budget-1200", 1000, 3, False, True),
            {"kind": "kv-end", "peak_bytes": 6 << 20, "budget_bytes": 256 << 20, "evicted": 0,
             "stored": 3, "refused": 0, "pins": 0, "pin_shortened": 0}]
    table = report(rows)
    assert "| 1 | fixed-k | 1/1 | 1000 / 400 | -60 % |" in table
    assert "| 2.00 / 3.00 | 1.50x | 100 % / 0 % |" in table
    assert "| B | 1 | 1 | 900 / 83 | 1000 | 100 | 10.00 | 0 % |" in table  # laid out as the earlier turn
    assert "most bytes held 6.0 MiB of a 256 MiB budget" in table
