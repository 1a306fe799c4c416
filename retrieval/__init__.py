"""Document store, chunking, embedding, FAISS index and retriever.

Knows nothing of HTTP or generation.
"""

import foundation  # noqa: F401  (sets the OpenMP spin count before torch loads)
