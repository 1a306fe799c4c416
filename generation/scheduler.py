"""Where the engine used to live: its names, re-exported from :mod:`generation.engine`.

The engine is now in rooms (:mod:`generation.engine`: request, scheduler, runner, KV cache,
core, messages). This module keeps the old import path working; new code imports from
:mod:`generation.engine` directly.
"""

from __future__ import annotations

from generation.engine.core import STEP_LOG, Engine
from generation.engine.messages import StepRecord
from generation.engine.request import Request
from generation.engine.scheduler import MIN_ROWS, ROW_MULTIPLE, padded_rows

#: The old name of :class:`generation.engine.request.Request`.
Sequence = Request

__all__ = ["MIN_ROWS", "ROW_MULTIPLE", "STEP_LOG", "Engine", "Request", "Sequence", "StepRecord",
           "padded_rows"]
