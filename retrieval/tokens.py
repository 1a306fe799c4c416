"""Token counting with the generator's tokenizer, with every special-token string kept as text.

Chunk token counts feed the TTFT budget, so they must come from the same
tokenizer that builds the prompt. Text from documents and questions is never
interpreted as control tokens: ``<|im_start|>`` inside a document is encoded
as ordinary characters (HF ``split_special_tokens=True``).
"""

from __future__ import annotations

from typing import Any, Protocol

from foundation.hashing import sha256_json


class TextTokenizer(Protocol):
    """What chunking and prompt assembly need from a tokenizer."""

    @property
    def tokenizer_id(self) -> str:
        """A stable identity (``sha256:`` over the tokenizer's vocabulary and config)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of plain ``text``; no special tokens added, none recognised."""
        ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each token's ``(start, end)`` character offsets in ``text``."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens rendered as their strings)."""
        ...


class HFTextTokenizer:
    """:class:`TextTokenizer` over a Hugging Face *fast* tokenizer."""

    def __init__(self, hf_tokenizer: Any, name: str = "") -> None:
        self.hf = hf_tokenizer
        self.name = name or getattr(hf_tokenizer, "name_or_path", "") or "hf-tokenizer"
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        state = backend.to_str() if backend is not None else repr(sorted(hf_tokenizer.get_vocab().items()))
        self._id = sha256_json({"name": "hf", "tokenizer_json": state})

    @property
    def tokenizer_id(self) -> str:
        """``sha256:`` of the tokenizer's serialised state (vocabulary, merges, normaliser)."""
        return self._id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added (special-token text is split as text)."""
        return list(self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's ``(start, end)`` character span in ``text``."""
        enc = self.hf(text, add_special_tokens=False, split_special_tokens=True,
                      return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, special tokens kept."""
        return str(self.hf.decode(ids, skip_special_tokens=False))
