"""Which chat template frames the prompt: the model's own, a file the user gives, or none (plain).

The choice, in order (``RAGBUDGET_CHAT_TEMPLATE`` is the ``chat_template`` setting):

1. ``chat_template`` names a Jinja file (a path), or one of the templates shipped in
   ``generation/chat_templates/`` by name (``gemma3``, ``chatml``): that template.
2. ``chat_template`` is ``plain``: no chat framing, the documented plain-completion
   layout (:data:`PLAIN`; for base models, see ``docs/engines.md``).
3. Unset: the model's own template: the tokenizer's ``chat_template`` (its
   ``tokenizer_config.json`` or ``chat_template.jinja``; for a GGUF file, the
   ``tokenizer.chat_template`` metadata, copied into the converted directory).
4. Otherwise: :class:`foundation.errors.InvalidConfig` at start, naming the
   setting. There is no silent fallback: a template whose markers are not special
   tokens of the tokenizer frames nothing the model was trained on (the
   ``<|im_end|>admin`` answers of ChatML markers on a Gemma tokenizer).

Whether the markers really are special tokens is checked where the template is
rendered (``app.prompting.prompt.PromptBuilder``), since that needs the rendered text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from foundation.errors import InvalidConfig
from foundation.hashing import sha256_text

BUNDLED_DIR = Path(__file__).resolve().parent / "chat_templates"
PLAIN = "plain"
MAX_TEMPLATE_BYTES = 256 * 1024

TemplateOrigin = Literal["model", "file", "bundled", "plain"]


@dataclass(frozen=True)
class ChatTemplate:
    """The template in force.

    Attributes:
        source: Jinja source; None for the plain-completion layout.
        origin: ``model`` (the tokenizer's own), ``file`` (a path the user gave),
            ``bundled`` (a template shipped with ragbudget, by name) or ``plain``.
        name: where it came from: the tokenizer's name, the file path, the bundled name, or ``plain``.
    """

    source: str | None
    origin: TemplateOrigin
    name: str

    @property
    def hash(self) -> str:
        """``sha256:`` of the template source (of ``"plain"`` for the plain layout)."""
        return sha256_text(self.source if self.source is not None else PLAIN)

    def describe(self) -> dict[str, Any]:
        """``{"origin", "name", "hash"}``, as recorded in receipts and shown by the CLI."""
        return {"origin": self.origin, "name": self.name, "hash": self.hash}


def bundled_templates() -> list[str]:
    """Names of the templates shipped in ``generation/chat_templates/``."""
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.jinja"))


def model_template_source(tokenizer: Any) -> str | None:
    """The tokenizer's own chat template, or None when it has none.

    Read from the wrapped HF tokenizer's ``chat_template``, else from a
    ``chat_template`` attribute of the :class:`retrieval.tokens.TextTokenizer` itself.
    """
    hf = getattr(tokenizer, "hf", None)
    holder = hf if hf is not None else tokenizer
    source = getattr(holder, "chat_template", None)
    if isinstance(source, dict):  # several named templates: the default one
        source = source.get("default")
    return source if isinstance(source, str) and source.strip() else None


def resolve_chat_template(tokenizer: Any, setting: str | None = None) -> ChatTemplate:
    """The chat template in force for ``tokenizer`` and the ``chat_template`` setting.

    Raises:
        InvalidConfig: the setting names a missing, unreadable, empty or oversized file;
            or it is unset and the model has no chat template of its own.
    """
    if setting is not None and setting.strip():
        value = setting.strip()
        if value == PLAIN:
            return ChatTemplate(None, "plain", PLAIN)
        if value in bundled_templates() and not Path(value).exists():
            path = BUNDLED_DIR / f"{value}.jinja"
            return ChatTemplate(path.read_text(encoding="utf-8"), "bundled", value)
        return ChatTemplate(_read_template_file(Path(value).expanduser()), "file", value)
    source = model_template_source(tokenizer)
    if source is None:
        name = getattr(tokenizer, "name", None) or "the model"
        raise InvalidConfig(
            f"{name} has no chat template (none in its tokenizer files or GGUF metadata), so its "
            "prompt cannot be framed. Set RAGBUDGET_CHAT_TEMPLATE to a Jinja template file, to a "
            f"bundled template ({', '.join(bundled_templates())}), or to 'plain' for the "
            "plain-completion layout (base models; see docs/engines.md)",
            code="no_chat_template", tokenizer=str(name))
    return ChatTemplate(source, "model", str(getattr(tokenizer, "name", "") or "model"))


def _read_template_file(path: Path) -> str:
    if not path.is_file():
        raise InvalidConfig(f"chat template file {path} does not exist (RAGBUDGET_CHAT_TEMPLATE); "
                            f"bundled templates: {', '.join(bundled_templates())}, or 'plain'",
                            code="no_chat_template", path=str(path))
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise InvalidConfig(f"chat template file {path} is larger than {MAX_TEMPLATE_BYTES} bytes",
                            path=str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidConfig(f"cannot read chat template file {path}: {exc}", path=str(path)) from exc
    if not text.strip():
        raise InvalidConfig(f"chat template file {path} is empty", path=str(path))
    return text
