"""Same query, same revision: bit-identical hits in a fresh process (index loaded or rebuilt there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import Engine

from retrieval.retriever import Retriever
from tests.conftest import CASES
from tests.retrieval.corpus import FixtureCorpus

ROOT = Path(__file__).resolve().parents[2]
V1 = (CASES / "doc_v1.txt").read_text(encoding="utf-8")
V2 = (CASES / "doc_v2_shorter_changed.txt").read_text(encoding="utf-8")


def child(engine: Engine, index_dir: Path, query: str, k: int, revision: int | None,
          which: str = "fake") -> dict:  # type: ignore[type-arg]
    """Run :mod:`tests.retrieval.retrieve_child` in a new interpreter."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "tests.retrieval.retrieve_child",
         engine.url.render_as_string(hide_password=False), str(index_dir), query, str(k),
         "-" if revision is None else str(revision), which],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_fresh_process_returns_bit_identical_scores(
        engine: Engine, corpus: FixtureCorpus, retriever: Retriever, index_dir: Path,
        tmp_path: Path) -> None:
    r1 = corpus.commit({"manual": V1})
    corpus.commit({"manual": V2})
    query = "gauge reading logbook pump"
    for rev in (r1, None):
        here = [[h.chunk_id, h.score.hex()] for h in retriever.retrieve(query, 12, rev).hits]
        assert child(engine, index_dir, query, 12, rev)["hits"] == here  # loads the saved index
        assert child(engine, tmp_path / "elsewhere", query, 12, rev)["hits"] == here  # rebuilds
