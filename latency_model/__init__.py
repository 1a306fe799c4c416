"""Prefill and decode cost models, fitting, profiles, roofline priors and the TTFT-budget planner.

Pure maths: imports neither ``retrieval`` nor ``receipts``; only ``calibration``
(at the room's edge) runs a model.
"""

import foundation  # noqa: F401  (sets the OpenMP spin count before torch loads)
