"""ragbudget's application room: settings, generation, prompts, the answer pipeline, API and CLI.

The only package that wires ``retrieval``, ``latency_model`` and ``receipts`` together.
"""

import foundation  # noqa: F401  (sets the OpenMP spin count before torch loads)
