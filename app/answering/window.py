"""The context window: what an answer's prompt and its output must fit, checked before it queues.

Refused as vLLM refuses them (``ContextLengthExceeded``, HTTP 400 ``context_length_exceeded``),
never cut short after the first token: an output limit as long as the window
(:func:`refuse_output_over_window`), a prompt without a chunk that fills it or leaves the
output asked for no room (:func:`fit_window`).
"""

from __future__ import annotations

from collections.abc import Callable

from foundation.errors import ContextLengthExceeded


def refuse_output_over_window(max_new: int | None, windows: Callable[[], int]) -> None:
    """Refuse an output limit as long as the largest context window in rotation: no prompt
    fits beside it, so it is the context-window error (as vLLM answers it) before the
    server's own cap (``invalid_max_new_tokens``) is checked.

    ``windows``: returns the largest context window in rotation (tokens); called only for an
    integer ``max_new``.

    Raises:
        ContextLengthExceeded: ``field`` ``max_new_tokens``, ``max_new_tokens``,
            ``context_window`` (no ``prompt_tokens``: the prompt is not built yet).
        Unavailable: ``engine_unavailable``, from ``windows`` (``AnswerPipeline.in_rotation``).
    """
    if max_new is None or isinstance(max_new, bool) or not isinstance(max_new, int):
        return  # absent, or a type check_max_new_tokens refuses
    window = windows()
    if max_new >= window:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {window} tokens. However, you requested "
            f"{max_new} tokens for the output alone. Please reduce the length of the output "
            f"(max tokens).", field="max_new_tokens", max_new_tokens=max_new, context_window=window)


def fit_window(prompt_tokens: int, max_new: int, defaulted: bool, window: int) -> int:
    """The output tokens an answer may take beside its prompt without a retrieved chunk.

    ``prompt_tokens``: scaffold, conversation, question and chat framing (k = 0);
    ``max_new``: the output tokens asked for, or the server's default when ``defaulted``
    (then cut to what the window leaves, as vLLM does when ``max_tokens`` is absent);
    ``window``: the model's context window. Returns ``max_new``, cut when defaulted.

    Raises:
        ContextLengthExceeded: the prompt alone fills the window (``field`` ``question``),
            or ``max_new`` asked for does not fit beside it (``field`` ``max_new_tokens``):
            refused before the request queues, never cut short after its first token.
    """
    fits = window - prompt_tokens
    if fits >= max_new:
        return max_new
    if fits >= 1 and defaulted:
        return fits
    field = "question" if fits < 1 else "max_new_tokens"
    raise ContextLengthExceeded(
        f"This model's maximum context length is {window} tokens. However, you requested "
        f"{prompt_tokens + max_new} tokens ({prompt_tokens} in the prompt, {max_new} for the "
        f"output). Please reduce the length of the "
        f"{'messages' if field == 'question' else 'output (max tokens)'}.",
        field=field, prompt_tokens=prompt_tokens, max_new_tokens=max_new, context_window=window)
