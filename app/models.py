"""Application tables: prompt scaffolds, latency profiles, API keys."""

from __future__ import annotations

from sqlalchemy import Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from foundation.db import Base
from retrieval.models import HASH_LEN


class Scaffold(Base):
    """A versioned prompt scaffold (system prompt + fixed instructions), content-addressed."""

    __tablename__ = "scaffolds"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    hash: Mapped[str] = mapped_column(String(HASH_LEN), unique=True)
    text: Mapped[str] = mapped_column(Text)
    created_at: Mapped[str] = mapped_column(String(40))


class LatencyProfileRow(Base):
    """A fitted latency profile; ``body`` is the profile's JSON exactly as saved to disk."""

    __tablename__ = "latency_profiles"

    id: Mapped[str] = mapped_column(String(HASH_LEN), primary_key=True)
    device: Mapped[str] = mapped_column(String(256), index=True)
    model_id: Mapped[str] = mapped_column(String(512))
    weights_hash: Mapped[str] = mapped_column(String(HASH_LEN))
    dtype: Mapped[str] = mapped_column(String(32))
    threads: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[str] = mapped_column(String(40), index=True)
    body: Mapped[str] = mapped_column(Text)


class ApiKey(Base):
    """An API key, stored only as a keyed hash of its secret, shown once at creation.

    ``key_hash``: ``hmac-sha256:<hex>`` keyed by ``salt``; keys made before that scheme hold a
    bare-hex salted scrypt hash until their first use re-hashes them (see :mod:`app.auth`).
    """

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    salt: Mapped[str] = mapped_column(String(64))
    key_hash: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[str] = mapped_column(String(40))
    revoked_at: Mapped[str | None] = mapped_column(String(40), nullable=True)

