"""CLI text outputs a user reads: the advise table explains its TTFT column and its choice,
``revisions`` lists by default, and ``advise`` falls back to the configured budget."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.cli.main import build_parser
from app.services import Services
from latency_model.profile import Profile
from tests.api.conftest import SENTINEL, api_settings, make_services


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory, api_profile: Profile) -> Iterator[Services]:
    root: Path = tmp_path_factory.mktemp("cli-out")
    svc = make_services(api_settings(root, default_ttft_budget_ms=777.0), api_profile)
    docs = root / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"pump{i}.txt").write_text(f"{SENTINEL} Note {i}.")
    assert run(svc, ["ingest", str(docs)]) == 0
    yield svc
    svc.close()


def run(services: Services, argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args, services) or 0)


def test_advise_table_shows_ttft_with_overhead_and_the_reason(services: Services, capsys: Any) -> None:
    assert run(services, ["advise", "What colour is the pump?", "--budget-ms", "2000"]) == 0
    out = capsys.readouterr().out
    assert "TTFT = overhead" in out and "TTFT p95" in out and "prefill p50" in out
    chosen = [ln for ln in out.splitlines() if ln.startswith("chosen k = ")]
    assert chosen and ": " in chosen[0].split(")", 1)[1]  # the planner's message follows


def test_advise_ttft_columns_are_prefill_plus_overhead(services: Services, capsys: Any) -> None:
    import json

    assert run(services, ["advise", "What colour is the pump?", "--budget-ms", "2000", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert run(services, ["advise", "What colour is the pump?", "--budget-ms", "2000"]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln[:3].strip().isdigit()]
    assert len(rows) == len(plan["rows"])
    # the overhead is measured per call, so compare each row's TTFT p95 - TTFT p50 (overhead cancels)
    for cells, r in zip(rows, plan["rows"], strict=True):
        assert int(cells[6]) - int(cells[5]) == pytest.approx(r["ttft_p95_ms"] - r["ttft_p50_ms"], abs=1)


def test_advise_without_a_budget_uses_the_configured_default(services: Services, capsys: Any) -> None:
    import json

    assert run(services, ["advise", "What colour is the pump?", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ttft_budget_ms"] == 777.0


def test_revisions_without_an_action_lists_them(services: Services, capsys: Any) -> None:
    assert run(services, ["revisions"]) == 0
    listed = capsys.readouterr().out
    assert run(services, ["revisions", "list"]) == 0
    assert listed == capsys.readouterr().out and "1" in listed


def test_plain_replay_does_not_load_the_generator(tmp_path: Path, api_profile: Profile) -> None:
    """Replay without ``--regenerate`` rebuilds the prompt with the generator's tokenizer only:
    an operator can check a 7B model's receipts on a machine that cannot load the model."""
    from app.answering.receipt_wiring import replay_receipt
    from tests.api.fakes import CharTokenizer
    from tests.retrieval.fakes import HashingEmbedder

    settings = api_settings(tmp_path, auth_enabled=False)
    writer = make_services(settings, api_profile)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "pump.txt").write_text(SENTINEL)
    assert run(writer, ["ingest", str(docs)]) == 0
    assert run(writer, ["ask", "What colour is the pump?", "--budget-ms", "5000"]) == 0
    from receipts.chain import list_receipts

    rid = list_receipts(writer.engine)[0][0]["id"]
    writer.close()

    reader = Services(settings)  # a fresh process's services: nothing loaded yet
    reader.__dict__["tokenizer"] = CharTokenizer()
    reader.__dict__["embedder"] = HashingEmbedder()
    report = replay_receipt(reader, rid)
    assert report.ok, report.render()
    assert "generator" not in reader.__dict__
    reader.close()
