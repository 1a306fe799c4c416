"""Silence per-tensor "Loading weights" progress bars while a local model loads.

transformers draws one tqdm bar per ``from_pretrained`` (a few ms for the models
here); in CLI output and server logs it is noise. Long operations (GGUF
dequantisation, embedding an ingest) keep their own progress bars.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_weight_loading() -> Iterator[None]:
    """Disable transformers' progress bars inside the block, restoring the previous state."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
