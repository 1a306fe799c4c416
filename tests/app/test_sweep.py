import json
from pathlib import Path

import pytest

from app.sweep import (
    SweepRow,
    apply_labels,
    bookindex_questions,
    load_labels,
    load_questions,
    summarise,
    write_outputs,
)
from foundation.errors import InvalidInput
from retrieval.bookindex import parse_bookindex

BOOKINDEX = """<html><body><div class="index"><div class="indexdiv"><h3>A</h3><dl>
<dt>archive_command configuration parameter, <a class="indexterm" href="runtime-config-wal.html#X">x</a></dt>
<dt>autovacuum, <a class="indexterm" href="routine-vacuuming.html#A">A</a></dt>
<dd><dl><dt>configuration parameters for, <a class="indexterm" href="runtime-config-autovacuum.html">B</a>,
<a class="indexterm" href="bookindex.html">self</a></dt></dl></dd>
</dl></div></div></body></html>"""


def test_bookindex_prefixes_subterms_and_drops_the_index_page():
    entries = dict((q, p) for q, p in parse_bookindex(BOOKINDEX))
    assert entries["archive_command configuration parameter"] == {"runtime-config-wal.html"}
    assert entries["autovacuum configuration parameters for"] == {"runtime-config-autovacuum.html"}
    assert all("bookindex.html" not in p for p in entries.values())


def test_bookindex_questions_are_a_seeded_sample_with_labels(tmp_path):
    (tmp_path / "bookindex.html").write_text(BOOKINDEX)
    a = bookindex_questions(tmp_path, 2, seed=1)
    b = bookindex_questions(tmp_path, 2, seed=1)
    assert a == b and len(a) == 2
    assert all(q["relevant"] for q in a)
    with pytest.raises(InvalidInput):
        bookindex_questions(tmp_path / "missing", 2)


def test_questions_and_labels_files(tmp_path):
    (tmp_path / "q.txt").write_text("first question\n\n second one \n")
    assert [q["question"] for q in load_questions(tmp_path / "q.txt")] == ["first question", "second one"]
    (tmp_path / "q.json").write_text(json.dumps([{"id": "a", "question": "x?", "relevant": ["p.html"]}]))
    assert load_questions(tmp_path / "q.json")[0]["relevant"] == ["p.html"]
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(InvalidInput):
        load_questions(tmp_path / "empty.json")
    (tmp_path / "l.json").write_text(json.dumps({"a": ["p.html"]}))
    assert load_labels(tmp_path / "l.json") == {"a": {"p.html"}}
    for bad in ("{not json", '["a"]', '{"a": "p.html"}'):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(InvalidInput) as exc:
            load_labels(tmp_path / "bad.json")
        assert exc.value.code == "invalid_labels"


def test_labels_match_by_id_then_text_and_report_the_unmatched():
    qs = [{"id": "a", "question": "first?"}, {"id": "b", "question": "second?"}]
    unmatched = apply_labels(qs, {"a": {"p.html"}, "second?": {"q.html", "r.html"}, "typo?": {"x"}})
    assert qs[0]["relevant"] == ["p.html"] and qs[1]["relevant"] == ["q.html", "r.html"]
    assert unmatched == ["typo?"]
    with pytest.raises(InvalidInput) as exc:
        apply_labels([{"id": "c", "question": "third?"}], {"typo?": {"x"}})
    assert exc.value.code == "invalid_labels"


def _row(q, k, measured, rel):
    return SweepRow(question_id=q, k=k, prompt_tokens=100 + 50 * k, cached_tokens=80,
                    computed_tokens=20 + 50 * k, overhead_ms=10.0, prefill_ms_median=measured - 10,
                    measured_ttft_ms=measured, predicted_p50_ms=measured, predicted_p95_ms=measured * 1.2,
                    relevant_in_top_k=rel)


def test_summary_reports_recall_and_budget_adherence(tmp_path):
    rows = [_row("a", 0, 100, False), _row("a", 1, 200, True), _row("b", 0, 120, False),
            _row("b", 1, 260, False)]
    choices = [{"question_id": "a", "budget_ms": 250, "chosen_k": 1},
               {"question_id": "b", "budget_ms": 250, "chosen_k": 1}]
    s = summarise(rows, choices, [250])
    assert s["per_k"][1]["recall_at_k"] == 0.5
    assert s["per_k"][0]["measured_ttft_ms_median"] == 110
    assert s["per_budget"][0]["within_budget"] == 0.5  # 200 <= 250, 260 > 250
    assert s["per_budget"][0]["budget_used_mean"] == pytest.approx((200 / 250 + 260 / 250) / 2)
    paths = write_outputs(tmp_path / "out", {"rows": rows, "choices": choices, "summary": s},
                          {"model": "m", "device": "cpu", "profile_source": "fitted"})
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 1000
    assert Path(paths["csv"]).read_text().count("\n") == 5


def test_last_sweep_record_round_trips_without_question_texts(tmp_path):
    from app.sweep import load_last, record_last

    assert load_last(tmp_path) is None
    summary = {"per_k": [{"k": 0, "measured_ttft_ms_median": 12.5}], "per_budget": []}
    record_last(tmp_path, {"summary": summary}, {"profile_id": "p", "questions": [{"question": "q"}]},
                {"json": "out/sweep.json"})
    last = load_last(tmp_path)
    assert last is not None and last["summary"] == summary
    assert last["meta"] == {"profile_id": "p", "n_questions": 1} and last["created_at"].endswith("+00:00")


def test_unreadable_last_sweep_record_is_none(tmp_path):
    from app.sweep import load_last

    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "last.json").write_text("{not json")
    assert load_last(tmp_path) is None
