"""The local engine, one room per job (the layout of nano-vllm's ``engine/`` and vLLM v1's core).

* :mod:`generation.engine.request`: one answer inside the engine (its prompt, position, KV,
  event queue).
* :mod:`generation.engine.scheduler`: which tokens of which answers the next step carries,
  a pure function of the answers' positions (``schedule(...) -> StepPlan``), and the row
  padding every step runs with; no torch, no I/O. The latency model prices these same plans
  (``latency_model.step_model``).
* :mod:`generation.engine.runner`: packs a plan's rows, pads them and runs the model's forward.
* :mod:`generation.engine.kv_cache`: each answer's KV buffer and the scaffold prefix cache.
* :mod:`generation.sampling`: a logits row to a token id.
* :mod:`generation.engine.core`: the step loop: admit, schedule, run, emit.
* :mod:`generation.engine.messages`: what the engine tells its readers (events, batch snapshots,
  the step log), as frozen dataclasses.

Nothing is imported here, so ``latency_model`` can read the scheduler and the messages
without loading the engine.
"""
