"""A deterministic, dependency-free embedder behind the ``retrieval.embedding.Embedder`` protocol.

Each word (lower-cased, punctuation stripped) adds a signed unit to two hashed
buckets; the sum is L2-normalised in float64 and cast to float32 once, so a
text's vector never depends on its batch companions. Texts with the same words
get bit-identical vectors, which makes exact score ties easy to build.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np

from retrieval.embedding import embedder_id_for

_WORD = re.compile(r"\w+")


class HashingEmbedder:
    """Bag-of-words hashing embedder: ``dim`` floats, ``max_seq_length`` word pieces (incl. 2 specials)."""

    def __init__(self, dim: int = 64, max_seq_length: int = 64, salt: str = "") -> None:
        self.dim = dim
        self.max_seq_length = max_seq_length
        self.identity: dict[str, Any] = {"model": "hashing-fake", "dim": dim, "salt": salt,
                                         "max_seq_length": max_seq_length, "normalize": True}
        self.embedder_id = embedder_id_for(self.identity)
        self.calls: list[int] = []  # texts per embed_documents call

    def _words(self, text: str) -> list[str]:
        return _WORD.findall(text.lower())

    def _vector(self, text: str) -> np.ndarray:
        v = np.zeros(self.dim, dtype=np.float64)
        for w in self._words(text)[: self.max_seq_length - 2]:
            digest = hashlib.sha256((self.identity["salt"] + w).encode()).digest()
            for j in (0, 4):
                bucket = int.from_bytes(digest[j:j + 4], "little") % self.dim
                v[bucket] += 1.0 if digest[8 + j] & 1 else -1.0
        norm = np.linalg.norm(v)
        if norm == 0:
            v[0] = 1.0
            norm = 1.0
        return (v / norm).astype(np.float32)

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        self.calls.append(len(texts))
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.stack([self._vector(t) for t in texts])

    def embed_query(self, text: str) -> tuple[np.ndarray, bool, int]:
        n = self.count_wordpieces(text)
        return self._vector(text), n > self.max_seq_length, n

    def count_wordpieces(self, text: str) -> int:
        return len(self._words(text)) + 2
