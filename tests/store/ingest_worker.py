"""A separate process that ingests batches (for the concurrency and kill -9 tests).

``python -m tests.store.ingest_worker DB_URL NAME BATCHES DOCS_PER_BATCH [GO_FILE]`` prints one
JSON line per committed batch: ``{"name", "batch", "revision", "shared_version"}``. It uses a
whitespace tokenizer so the process starts fast; the store does not care which tokenizer it is.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from foundation.db import make_engine
from retrieval.chunking import ChunkerConfig
from retrieval.store import IngestItem, ingest_batch


class WordTokenizer:
    """One token per run of non-space characters (a :class:`retrieval.tokens.TextTokenizer`)."""

    tokenizer_id = "sha256:" + "0" * 64

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
        return [len(text[a:b]) for a, b in spans], spans

    def encode(self, text: str) -> list[int]:
        return self.encode_with_offsets(text)[0]

    def decode(self, ids: list[int]) -> str:
        return " ".join("x" * i for i in ids)


def batch_items(name: str, batch: int, docs: int) -> list[IngestItem]:
    body = " ".join(f"Sentence {k} of {name} batch {batch}." for k in range(40))
    items = [IngestItem("shared", text=f"shared document written by {name} in batch {batch}")]
    items += [IngestItem(f"{name}/{batch}/{d}", text=f"{body} Document {d}.") for d in range(docs)]
    return items


def main(argv: list[str]) -> int:
    url, name, batches, docs = argv[0], argv[1], int(argv[2]), int(argv[3])
    if len(argv) > 4:
        go = Path(argv[4])
        while not go.exists():
            time.sleep(0.01)
    engine = make_engine(url)
    for b in range(batches):
        report = ingest_batch(engine, batch_items(name, b, docs), tokenizer=WordTokenizer(),
                              chunker_config=ChunkerConfig(32, 4))
        shared = next(r for r in report.results if r.document_id == "shared")
        print(json.dumps({"name": name, "batch": b, "revision": report.revision,
                          "shared_version": shared.version}), flush=True)
    engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
