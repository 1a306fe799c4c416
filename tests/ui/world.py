"""A small, fully real console world over fake models: a corpus, answers with receipts, a supersede.

Built on :mod:`tests.api.conftest` (fake tokenizer, embedder and generator; real
store, retriever, planner, prompt, receipts and replay). History:

* revision 1: four short operations notes (written for these tests);
* three answers within a generous budget and one over a tiny budget (a slow first token);
* revision 2: the first document the first answer cited is updated, so that answer's
  receipt now cites a superseded version.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.answering.state import AnswerRequest
from app.api.app import create_app
from app.auth import create_key
from app.services import Services
from generation.base import GenParams, TokenEvent, TokenStream
from latency_model.profile import Profile
from retrieval.chunking import ChunkerConfig
from retrieval.store import IngestItem, ingest_batch
from tests.api.conftest import api_settings, make_services
from tests.api.fakes import CharTokenizer, EchoGenerator, wrapped

DOCS = {
    "ops/wal-archiving.md": (
        "Continuous archiving keeps every completed WAL segment. Set archive_mode to on and give "
        "archive_command a shell command that copies %p to the archive and exits zero only after the "
        "copy is durable.\n\nA failing archive_command is retried; segments pile up in pg_wal until it "
        "succeeds, so watch the archiver statistics view."),
    "ops/base-backups.md": (
        "A base backup is a copy of the data directory taken while the server runs. pg_basebackup "
        "streams one over the replication protocol and can include the WAL needed to make it "
        "consistent.\n\nKeep at least two base backups and the WAL between them."),
    "ops/vacuum.md": (
        "Autovacuum removes dead row versions and refreshes planner statistics. Tune "
        "autovacuum_vacuum_scale_factor down for large, busy tables.\n\nA long-running transaction "
        "holds back the xmin horizon and stops vacuum from removing anything newer."),
    "ops/logical-dump.md": (
        "pg_dump writes a logical backup of one database: SQL or a custom-format archive that "
        "pg_restore reads. It takes a consistent snapshot and does not block writers.\n\nUse "
        "pg_dumpall for roles and tablespaces."),
}
QUESTIONS = ("How do I set up continuous archiving with archive_command?",
             "How often should I take a base backup?",
             "Why does autovacuum not remove dead rows?")
REPLY = "Set archive_mode = on and point archive_command at a durable copy; check the archiver view."
WITHIN_BUDGET_MS = 1_000.0
TINY_BUDGET_MS = 2.0


class SlowFirstToken(EchoGenerator):
    """:class:`EchoGenerator` whose first token waits ``delay_s`` (a slow prefill), so a tiny budget
    is missed for certain."""

    def __init__(self, tokenizer: CharTokenizer, reply: str, delay_s: float = 0.0) -> None:
        super().__init__(tokenizer, reply=reply)
        self.delay_s = delay_s

    def stream(self, prompt_ids: list[int], *, cached_prefix_ids: list[int] | None = None,
               params: GenParams, cancel: threading.Event | None = None,
               messages: list[dict[str, str]] | None = None,
               prefill_chunk: int | None = None) -> TokenStream:
        def events(inner: TokenStream) -> Iterator[TokenEvent]:
            if self.delay_s:
                time.sleep(self.delay_s)
            yield from inner

        return wrapped(super().stream(prompt_ids, cached_prefix_ids=cached_prefix_ids, params=params,
                                      cancel=cancel, messages=messages), events)


@dataclass
class ConsoleWorld:
    """The app, its services, one key per role and the receipts written."""

    app: Any
    services: Services
    keys: dict[str, str]
    receipts: list[str] = field(default_factory=list)
    over_budget: str = ""
    superseded_receipt: str = ""
    superseded_document: str = ""


def _ingest(services: Services, items: list[IngestItem]) -> None:
    s = services.settings
    ingest_batch(services.engine, items, tokenizer=services.tokenizer,
                 chunker_config=ChunkerConfig(s.chunk_tokens, s.chunk_overlap_tokens),
                 embedder=services.embedder, max_document_bytes=s.max_document_bytes)


def build_world(root: Path, profile: Profile, **settings: Any) -> ConsoleWorld:
    """Create the world under ``root`` (SQLite, auth on unless overridden)."""
    tokenizer = CharTokenizer()
    generator = SlowFirstToken(tokenizer, REPLY)
    services = make_services(api_settings(root, **settings), profile, generator)
    app = create_app(services=services)
    keys = {role: create_key(services.engine, role, f"{role} key")[1] for role in ("copilot", "operator",
                                                                                   "admin")}
    _ingest(services, [IngestItem(doc, text=text, kind="md") for doc, text in DOCS.items()])
    world = ConsoleWorld(app=app, services=services, keys=keys)
    pipeline = app.state.pipeline
    pipeline.warm()
    for q in QUESTIONS:
        world.receipts.append(pipeline.answer(AnswerRequest(question=q, ttft_budget_ms=WITHIN_BUDGET_MS))
                              .receipt_id)
    generator.delay_s = 0.05
    world.over_budget = pipeline.answer(AnswerRequest(question="What does pg_dump write?",
                                                      ttft_budget_ms=TINY_BUDGET_MS)).receipt_id
    generator.delay_s = 0.0
    first = world.receipts[0]
    from receipts.chain import get_receipt
    from receipts.schema import cited_candidates

    cited = cited_candidates(get_receipt(services.engine, first))
    assert cited, "the first answer cited nothing; the world needs a cited document"
    doc = cited[0]["document_id"]
    _ingest(services, [IngestItem(doc, text=DOCS[doc] + "\n\nSince this release, archive_library "
                                  "can replace archive_command.", kind="md")])
    world.superseded_receipt, world.superseded_document = first, doc
    return world
