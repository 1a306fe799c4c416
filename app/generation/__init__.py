"""Generation: the :class:`~app.generation.base.Generator` contract and its two backends.

Use :func:`load_generator` (through ``Services.generator``, which loads it once
per process); nothing heavy is imported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from app.generation.base import GenerationStats, Generator, GenParams, TokenEvent
from foundation.errors import InvalidConfig

if TYPE_CHECKING:
    from app.settings import Settings

__all__ = ["Generator", "GenerationStats", "GenParams", "TokenEvent", "load_generator"]


def load_generator(settings: Settings, services: Any) -> Generator:
    """Build the configured generator.

    ``local``: the model in ``services.generator_dir`` (the packaged SmolLM2 unless
    ``generator_path`` is set), sharing ``services.tokenizer``. ``remote``: an
    OpenAI-compatible server at ``remote_base_url`` serving ``remote_model``.

    Raises:
        InvalidConfig: remote backend without base URL or model, or an unloadable model.
    """
    if settings.generator_backend == "remote":
        from app.generation.remote import RemoteGenerator

        if not settings.remote_base_url or not settings.remote_model:
            raise InvalidConfig("generator_backend=remote needs remote_base_url and remote_model")
        return RemoteGenerator(settings.remote_base_url, settings.remote_model,
                               tokenizer=services.tokenizer, api_key=settings.remote_api_key,
                               tokenizer_source=settings.remote_tokenizer)
    from app.assets import PACKAGED_GENERATOR_ID
    from app.generation.local import LocalGenerator

    model_id = settings.generator_path or PACKAGED_GENERATOR_ID
    return LocalGenerator(services.generator_dir, tokenizer=services.tokenizer, model_id=model_id,
                          device=settings.generator_device, dtype=settings.generator_dtype,
                          threads=settings.torch_threads)
