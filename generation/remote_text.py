"""Token-id prompts for servers whose ``/completions`` takes text only (llama-cpp-python's server).

ragbudget lays every prompt out as token ids (``app.prompting.prompt``); its receipts hash
those ids. A server that only takes a text prompt (llama-cpp-python's
``llama_cpp.server``: ``prompt: str | list[str]``) tokenizes the text itself, with
special-token strings recognised (``special=True``) and a BOS token added in front
when the model's GGUF says so (``tokenizer.ggml.add_bos_token``). So the text sent is
the decoded ids, less a leading BOS the server will add back, and, where the server
offers ``POST /extras/tokenize`` (llama-cpp-python does: same ``special=True`` and
BOS rule as its completions route), each prompt's server-side ids are checked
against ragbudget's before it is sent:

* the same ids: nothing to record;
* the same text split differently, with the same special tokens (the engine
  tokenizes the whole text at once and merges whitespace across the segment
  boundaries that ragbudget encodes one by one, e.g. a chunk ending in ``\n``
  before ``\n\n[2]``): the answer goes ahead and the engine's own ids are
  reported (:class:`EnginePrompt`, recorded in the receipt under
  ``extra.engine_prompt``): count, hash and the first differing position;
* a different set of special tokens (document text the engine would read as
  control tokens, such as ``<|im_start|>`` inside a chunk, or a lost BOS): a
  :class:`BackendError` (code ``prompt_mismatch``); such a prompt is never sent.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from foundation.errors import BackendError
from foundation.hashing import sha256_ints
from retrieval.tokens import TextTokenizer

PROBE_TEXT = "Hello"


@dataclass(frozen=True)
class EnginePrompt:
    """The engine's own ids for a prompt whose text it split differently from ragbudget.

    Attributes:
        prompt_tokens: how many ids the engine computed.
        token_ids_hash: ``sha256:`` of those ids (:func:`foundation.hashing.sha256_ints`).
        first_difference: first position where they differ from ragbudget's ids.
    """

    prompt_tokens: int
    token_ids_hash: str
    first_difference: int

    def to_dict(self) -> dict[str, Any]:
        """``{prompt_tokens, token_ids_hash, first_difference}`` as recorded in a receipt."""
        return asdict(self)


def special_ids(tokenizer: TextTokenizer) -> frozenset[int]:
    """Ids of the tokenizer's special and added tokens (HF), or of tiktoken's special tokens."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return frozenset(int(i) for i in [*hf.all_special_ids, *getattr(hf, "added_tokens_decoder", {})])
    encoding = getattr(tokenizer, "encoding", None)
    if encoding is not None:
        return frozenset(int(encoding.encode_single_token(t)) for t in encoding.special_tokens_set)
    return frozenset()


class TextPromptCodec:
    """Turns prompt ids into the text a text-only completions server reads back as the same ids.

    Args:
        client: the generator's HTTP client.
        base_url: API root including the version (``.../v1``).
        model: model name sent with every request.
        tokenizer: the served model's tokenizer.
    """

    def __init__(self, client: httpx.Client, base_url: str, model: str, tokenizer: TextTokenizer) -> None:
        self.client, self.base_url, self.model, self.tokenizer = client, base_url, model, tokenizer
        self.server_adds_bos = False
        self.probed = False
        self.tokenize_url: str | None = None
        hf = getattr(tokenizer, "hf", None)
        bos = getattr(hf, "bos_token_id", None) if hf is not None else None
        self.bos_id: int | None = int(bos) if isinstance(bos, int) else None
        self._special = special_ids(tokenizer)

    def probe(self) -> bool:
        """True when the server answers a one-token text completion; learns its BOS rule.

        False for a ragbudget server (its response carries a ``ragbudget`` field): its
        ``/v1/completions`` is a RAG answer, not a plain continuation of the text.

        The BOS rule comes from ``/extras/tokenize`` when offered, else from the
        ``usage.prompt_tokens`` of the probe (one more than ragbudget counts: a BOS was added).
        """
        body = {"model": self.model, "prompt": PROBE_TEXT, "max_tokens": 1, "stream": False,
                "temperature": 0.0}
        try:
            r = self.client.post(f"{self.base_url}/completions", json=body)
            obj = r.json() if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return False
        if not isinstance(obj, dict) or not obj.get("choices"):
            return False
        if "ragbudget" in obj:
            # Another ragbudget server: its /v1/completions answers the prompt as a question,
            # with retrieval, instead of continuing the text; it is driven through chat.
            return False
        self.probed = True
        plain = self.tokenizer.encode(PROBE_TEXT)
        served = self._server_ids(PROBE_TEXT)
        if served is not None:
            self.tokenize_url = self._tokenize_url()
        else:
            usage = obj.get("usage") or {}
            count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
            served = [-1] * int(count) if isinstance(count, int) else list(plain)
        self.server_adds_bos = len(served) == len(plain) + 1
        return True

    def text_for(self, prompt_ids: list[int]) -> str:
        """The prompt text: decoded ids, special tokens as their strings, less a BOS the server adds."""
        ids = prompt_ids
        if self.server_adds_bos and self.bos_id is not None and ids[:1] == [self.bos_id]:
            ids = ids[1:]
        return self.tokenizer.decode(ids)

    def verify(self, prompt_ids: list[int], text: str) -> EnginePrompt | None:
        """Compare the server's ids for ``text`` with ``prompt_ids`` (when the server can be asked).

        Returns:
            None when they are equal (or the server has no tokenize route); an
            :class:`EnginePrompt` when only the split of plain text differs.

        Raises:
            BackendError: code ``prompt_mismatch`` when the special tokens differ (count and
                ids), with the first differing position and both lengths.
        """
        if self.tokenize_url is None:
            return None
        served = self._server_ids(text)
        if served is None:
            raise BackendError("the server's /extras/tokenize stopped answering", code="prompt_mismatch")
        expected = list(prompt_ids)
        if served == expected:
            return None
        first = next((i for i, (a, b) in enumerate(zip(served, expected, strict=False)) if a != b),
                     min(len(served), len(expected)))
        specials_served = Counter(i for i in served if i in self._special)
        specials_ours = Counter(i for i in expected if i in self._special)
        if specials_served != specials_ours:
            raise BackendError(
                f"the server reads the prompt text with other special tokens than ragbudget laid out "
                f"({sum(specials_served.values())} vs {sum(specials_ours.values())}; first difference at "
                f"token {first} of {len(expected)}): document text would be read as control tokens, or "
                "the remote tokenizer (RAGBUDGET_REMOTE_TOKENIZER) is not the served model's",
                code="prompt_mismatch", first_difference=first, server_tokens=len(served),
                prompt_tokens=len(expected))
        return EnginePrompt(len(served), sha256_ints(served), first)

    def _tokenize_url(self) -> str:
        root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        return f"{root}/extras/tokenize"

    def _server_ids(self, text: str) -> list[int] | None:
        """The server's ids for ``text`` from ``/extras/tokenize``, or None when it has no such route."""
        try:
            r = self.client.post(self._tokenize_url(), json={"input": text, "model": self.model})
            obj: Any = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        tokens = obj.get("tokens") if isinstance(obj, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return None
        return [int(t) for t in tokens]
