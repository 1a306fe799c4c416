"""Store tables: revisions, documents, versions (and tombstones), chunks, embeddings, learned boilerplate.

Nothing here is ever updated in place except ``DocumentVersion.live_until_revision``,
which is set exactly once, when a later revision supersedes or deletes that version.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from foundation.db import Base

HASH_LEN = 71  # "sha256:" + 64 hex


class Revision(Base):
    """One committed ingest batch. ``number`` grows by one per batch, starting at 1."""

    __tablename__ = "revisions"

    number: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    created_at: Mapped[str] = mapped_column(String(40))  # ISO-8601 UTC
    root_hash: Mapped[str] = mapped_column(String(HASH_LEN))
    live_documents: Mapped[int] = mapped_column(Integer)
    added: Mapped[int] = mapped_column(Integer, default=0)
    updated: Mapped[int] = mapped_column(Integer, default=0)
    deleted: Mapped[int] = mapped_column(Integer, default=0)
    unchanged: Mapped[int] = mapped_column(Integer, default=0)
    note: Mapped[str | None] = mapped_column(Text, nullable=True)


class Document(Base):
    """A stable document id: the caller's id, or the path relative to the ingest root."""

    __tablename__ = "documents"

    id: Mapped[str] = mapped_column(String(1024), primary_key=True)
    created_revision: Mapped[int] = mapped_column(ForeignKey("revisions.number"))


class DocumentVersion(Base):
    """Version ``version`` (1, 2, ...) of a document, or a tombstone when ``is_tombstone``.

    Live at revision R iff ``live_from_revision <= R`` and (``live_until_revision``
    is NULL or ``> R``) and not a tombstone. ``text`` is the normalised text a
    model reads; ``content_hash`` is ``sha256:`` of its UTF-8 bytes.
    """

    __tablename__ = "document_versions"
    __table_args__ = (
        UniqueConstraint("document_id", "version", name="uq_document_versions_doc_version"),
        Index("ix_document_versions_live", "live_from_revision", "live_until_revision"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    document_id: Mapped[str] = mapped_column(ForeignKey("documents.id"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    is_tombstone: Mapped[bool] = mapped_column(Boolean, default=False)
    content_hash: Mapped[str | None] = mapped_column(String(HASH_LEN), nullable=True)
    source_hash: Mapped[str | None] = mapped_column(String(HASH_LEN), nullable=True)
    text: Mapped[str | None] = mapped_column(Text, nullable=True)
    metadata_json: Mapped[str] = mapped_column(Text, default="{}")
    chunker_id: Mapped[str | None] = mapped_column(String(HASH_LEN), nullable=True)
    live_from_revision: Mapped[int] = mapped_column(ForeignKey("revisions.number"))
    live_until_revision: Mapped[int | None] = mapped_column(
        ForeignKey("revisions.number"), nullable=True
    )


class Chunk(Base):
    """A token window of one document version, with exact character offsets.

    ``id`` is deterministic (derived from document id, version and ordinal), so
    the same corpus history gives the same ids in any database; it is the FAISS
    id and the tie-breaker for equal scores.
    """

    __tablename__ = "chunks"
    __table_args__ = (
        UniqueConstraint("version_id", "ordinal", name="uq_chunks_version_ordinal"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    version_id: Mapped[int] = mapped_column(ForeignKey("document_versions.id"), index=True)
    ordinal: Mapped[int] = mapped_column(Integer)
    start_char: Mapped[int] = mapped_column(Integer)
    end_char: Mapped[int] = mapped_column(Integer)
    n_tokens: Mapped[int] = mapped_column(Integer)
    chunk_hash: Mapped[str] = mapped_column(String(HASH_LEN), index=True)
    text: Mapped[str] = mapped_column(Text)


class Embedding(Base):
    """A chunk text's vector under one embedder: ``(dim,) float32`` little-endian bytes."""

    __tablename__ = "embeddings"

    chunk_hash: Mapped[str] = mapped_column(String(HASH_LEN), primary_key=True)
    embedder_id: Mapped[str] = mapped_column(String(HASH_LEN), primary_key=True)
    dim: Mapped[int] = mapped_column(Integer)
    vector: Mapped[bytes] = mapped_column(LargeBinary)


class EmbedderRecord(Base):
    """The identity of an embedder: ``id`` is ``sha256:`` over its canonical config JSON."""

    __tablename__ = "embedders"

    id: Mapped[str] = mapped_column(String(HASH_LEN), primary_key=True)
    config_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[str] = mapped_column(String(40))


class BoilerplateBlock(Base):
    """A block learned as boilerplate (``retrieval.boilerplate``), kept so later batches drop it too.

    ``block_hash`` is the block's key (``sha256:`` of its whitespace-collapsed
    text), ``text`` that text; ``pages`` of the learning batch's ``batch_pages``
    HTML pages held it; ``revision`` is the revision that batch created (None if
    it created none). Rows are only ever inserted.
    """

    __tablename__ = "boilerplate_blocks"

    block_hash: Mapped[str] = mapped_column(String(HASH_LEN), primary_key=True)
    text: Mapped[str] = mapped_column(Text)
    pages: Mapped[int] = mapped_column(Integer)
    batch_pages: Mapped[int] = mapped_column(Integer)
    revision: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[str] = mapped_column(String(40))  # ISO-8601 UTC
