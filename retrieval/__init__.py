"""Document store, chunking, embedding, FAISS index and retriever.

Knows nothing of HTTP or generation.
"""
