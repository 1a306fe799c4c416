"""The answer path: one question in, one answer and its receipt out.

Who waits and who answers: the request and the answer's state (``state``), the one
answer shape every reader shares (``types``), the bounded queue for the model
(``genqueue``), the requests already arrived that a new plan leaves room for
(``arrivals``), the plan bands and their online correction (``bands``), the prefix-cache
lookup per k (``kv_lookup``), the follow-up that continues its earlier turn
(``followup``), the pipeline (``pipeline``: retrieve, plan, generate) and the answer's
receipt (``receipt``; replay's wiring in ``receipt_wiring``).

May import :mod:`app.prompting` (the prompt it lays out), never the interfaces
(``app.api``, ``app.cli``, ``app.ui``), which import it.
"""
