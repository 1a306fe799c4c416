"""A second model family end to end: Gemma 3 270M (a base-model GGUF without a template) via the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.cli.main import main

pytestmark = pytest.mark.slow

DOCS = {
    "pump.txt": "Pump station maintenance. The circulation pump is inspected on the first Monday of "
                "every month by the duty engineer.",
    "valves.txt": "Valve replacement policy. Gate valves are replaced every five years.",
}
QUESTION = "When is the circulation pump inspected?"


@pytest.fixture
def gemma_env(gemma_gguf: Path, gemma_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """CLI environment: the Gemma GGUF as RAGBUDGET_GENERATOR_PATH (already converted), 2 documents."""
    data = tmp_path / "data"
    (data / "models").mkdir(parents=True)
    from generation.assets import converted_gguf_dir

    # the conversion the fixture made under ragbudget-data, reused by this data dir (a symlink)
    (converted_gguf_dir(data, gemma_gguf)).symlink_to(gemma_dir, target_is_directory=True)
    monkeypatch.setenv("RAGBUDGET_DATA_DIR", str(data))
    monkeypatch.setenv("RAGBUDGET_GENERATOR_PATH", str(gemma_gguf))
    monkeypatch.setenv("RAGBUDGET_TORCH_THREADS", "1")
    monkeypatch.delenv("RAGBUDGET_CHAT_TEMPLATE", raising=False)
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    return docs


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    code = main([*argv, "--json"])
    out = capsys.readouterr()
    text = out.out.strip()
    return code, (json.loads(text) if text.startswith("{") else None), out.err


def test_gemma_without_a_template_is_refused_with_a_clear_error(
        gemma_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(capsys, "ingest", str(gemma_env))[0] == 0
    code, out, err = cli(capsys, "ask", QUESTION, "--budget-ms", "60000")
    assert code != 0 and "no chat template" in (err + json.dumps(out))
    assert "RAGBUDGET_CHAT_TEMPLATE" in (err + json.dumps(out))


def test_gemma_with_its_family_template_answers_and_replays(
        gemma_env: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGBUDGET_CHAT_TEMPLATE", "gemma3")
    assert cli(capsys, "ingest", str(gemma_env))[0] == 0
    code, advice, _ = cli(capsys, "advise", QUESTION, "--budget-ms", "60000")
    assert code == 0 and advice["plan"]["chosen_k"] >= 1
    code, s, err = cli(capsys, "ask", QUESTION, "--budget-ms", "60000", "--max-new-tokens", "24")
    assert code == 0 and s["status"] == "ok", err
    from app.services import Services
    from app.settings import get_settings
    from receipts.chain import get_receipt

    services = Services(get_settings())
    body = get_receipt(services.engine, s["receipt_id"])
    services.close()
    assert body["generator"]["chat_template"]["name"] == "gemma3"
    text = body["output"]["text"]
    assert "<|im_end|>" not in text and "<start_of_turn>" not in text and "<end_of_turn>" not in text
    code, report, _ = cli(capsys, "replay", s["receipt_id"], "--regenerate")
    checks = {c["name"]: c["status"] for c in report["checks"]}
    assert code == 0 and checks["prompt"] == "ok" and checks["regenerate"] == "ok", report
