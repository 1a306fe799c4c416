"""Typed answers and plans: what the pipeline returns, the API serves and the CLI prints.

One family of pydantic models (docs/architecture.md, "Contracts": small pydantic
families) is the single shape of an answer everywhere:
:class:`Answer` is built by :mod:`app.answering.pipeline`, recorded by :mod:`app.metrics`,
written into the receipt, returned by ``POST /v1/answer`` (its response model;
the ``final`` server-sent event carries the same object) and printed by
``ragbudget ask``. :class:`Advice` and :class:`AdviceCurve` are the same for
``POST /v1/advise`` and ``GET /v1/advise/curve``; :class:`PlanPublic` mirrors
:class:`latency_model.planner.Plan`.

Units live in the names: ``*_ms`` milliseconds (``time.perf_counter`` deltas),
token counts are generator tokens. Timing definitions follow vLLM's benchmark
conventions (see :mod:`app.answering.pipeline`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from latency_model.planner import Plan

# ``interrupted`` is never an answer's own status: it is written later, for an answer whose
# process died while it generated (receipts.journal); listed so every status has one type.
AnswerStatus = Literal["ok", "cancelled", "failed", "interrupted"]
FinishReason = Literal["stop", "length", "cancelled", "error"]


class ChunkHit(BaseModel):
    """One retrieved chunk, the one shape every reader shows it in, in rank order.

    Declared once here; the others derive from it: the answer's citations and candidates
    (:class:`Citation`), the hits of ``POST /v1/retrieve`` (``app.api.routes_retrieval.HitPublic``),
    a receipt's ``candidates[]`` (:meth:`receipt_candidate`) and the console's receipt page
    (``app.ui.receipt_view.CandidateView``). Built from a :class:`retrieval.retriever.Hit`, a
    :class:`receipts.stored.StoredHit` or a receipt's candidate with :meth:`fields_of`.
    """

    rank: int = Field(description="1-based rank in the retrieval")
    score: float = Field(description="exact float32 inner product, as stored")
    chunk_id: str = Field(description="decimal string of the 63-bit chunk id (beyond 2**53, so not a "
                                      "JSON number; docs/receipts.md)")
    document_id: str
    version: int = Field(description="document version the chunk belongs to")
    chunk_hash: str = Field(description="sha256:<hex> of the chunk text")

    @staticmethod
    def fields_of(hit: Any) -> dict[str, Any]:
        """The shared fields of ``hit`` (an object with these attributes, or a receipt's
        candidate dict), the chunk id as its decimal string."""
        def get(name: str) -> Any:
            return hit[name] if isinstance(hit, dict) else getattr(hit, name)

        return {"rank": get("rank"), "score": get("score"), "chunk_id": str(get("chunk_id")),
                "document_id": str(get("document_id")), "version": get("version"),
                "chunk_hash": get("chunk_hash")}

    def receipt_candidate(self, slot: int) -> dict[str, Any]:
        """This chunk as a receipt's ``candidates[]`` entry with its prompt ``slot``; the chunk
        id as the integer the receipt schema takes (:mod:`receipts.schema` writes it)."""
        return {"rank": self.rank, "score": self.score, "chunk_id": int(self.chunk_id),
                "document_id": self.document_id, "version": self.version,
                "chunk_hash": self.chunk_hash, "slot": slot}


class Citation(ChunkHit):
    """One retrieved chunk as cited (or offered as a candidate), in rank order, with its place
    in the prompt."""

    slot: int | None = Field(None, description="the prompt slot of this chunk's text (app.prompting.slots: "
                             "candidates with the same text share one; slots open in rank order)")
    shown_as: int | None = Field(None, description="the number [n] the prompt labels this chunk "
                                 "with: its place in the prompt's layout (app.prompting.layout; the slot "
                                 "itself in rank order); None: not in the prompt")

    @classmethod
    def of(cls, hit: Any, slot: int | None = None, shown_as: int | None = None) -> Citation:
        """From a :class:`retrieval.retriever.Hit` (or anything with the same attributes)."""
        return cls(**ChunkHit.fields_of(hit), slot=slot, shown_as=shown_as)

    @classmethod
    def of_hits(cls, hits: list[Any], k: int | None = None, order: list[int] | None = None) -> list[Citation]:
        """Citations of ``hits`` (rank order) with their slots; with ``k``, only those shown in a
        prompt of ``k`` slots (every source of each slot, copies included), each with its number in
        that prompt: ``order`` (the slots in the order shown, ``Prompt.order``; default rank order)."""
        from app.prompting.layout import shown_as
        from app.prompting.slots import hit_slots

        places = shown_as(order if order is not None else list(range(1, (k or 0) + 1)))
        return [cls.of(h, n, places.get(n) if k is not None else None)
                for h, n in zip(hits, hit_slots(hits), strict=True) if k is None or n <= k]


class AnswerError(BaseModel):
    """Why an answer failed after generation started (``status == "failed"``)."""

    code: str
    message: str


class PlanBatch(BaseModel):
    """The local engine's batch a plan was made beside (``app.answering.bands.batch_of``): what the
    batch model (``latency_model.step_model.batched_step_shapes``) replayed for it."""

    decoding: list[tuple[int, int]] = Field(description="per running answer that is decoding: "
                                            "[context tokens, decode steps left]")
    prefilling: list[tuple[int, int, int | None]] = Field(
        description="per answer prefilling ahead of this one, in the engine's prefill order: "
        "[prompt tokens left, next position, max_new_tokens (null: not known)]")


class PredictedTTFT(BaseModel):
    """The plan's prediction for the chosen ``k``.

    ``ttft_*_ms`` = measured pre-prefill overhead + the profile's prefill p50/p95,
    the same quantity as the measured ``timings.ttft_ms``; ``None`` when nothing
    fitted (no row was chosen).
    """

    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    prefill_p50_ms: float | None
    overhead_ms: float = Field(description="time before prefill the plan counted, ms: measured (auth, "
                               "parsing, retrieval, queue wait) up to when k was chosen, plus the "
                               "predicted wait when k was chosen before the model was free")
    profile_id: str
    profile_source: str = Field(description="fitted or prior")
    wait_ms: float | None = Field(None, description="the queue's predicted wait on arrival (running "
                                  "answer's remaining decode steps x TPOT + prefills and max_new_tokens "
                                  "of those ahead), ms")
    late_bound: bool = Field(False, description="k was chosen when the request got the model")
    correction_factor: float | None = Field(None, description="online correction factor applied to "
                                            "the fitted prefill prediction (None: correction off)")
    p95_multiplier: float | None = Field(None, description="conformal p95/p50 multiplier in force "
                                         "(None: too few answers yet, or correction off)")
    machine_speed: float | None = Field(None, description="the machine's speed the correction was "
                                        "scaled to: engine step time over the step model's, median "
                                        "of the latest steps (None: not read, or correction off)")
    correction_group: str | None = Field(None, description="the answers that set the factor and "
                                         "multiplier: 'alone' or 'batched' (the plan's own group), "
                                         "None: the pooled window, or correction off")
    batch: PlanBatch | None = Field(None, description="the engine batch the plan was made beside "
                                    "(None: planned with nothing else on the engine)")
    engine_id: str | None = Field(None, description="the engine the answer was routed to: the "
                                  "configured engine whose plan carried the most context within the "
                                  "budget ('default' when one engine is configured)")
    cached_tokens_per_k: list[int] | None = Field(
        None, description="per k = 0..K, the prompt tokens the plan priced as served from the "
        "engine's prefix KV cache (looked up in the local engine's block cache when k was chosen; "
        "the scaffold alone for an engine that cannot say)")
    computed_tokens_per_k: list[int] | None = Field(
        None, description="per k = 0..K, the prompt tokens the plan priced as prefilled")


class AnswerTimings(BaseModel):
    """Measured times of one answer, ms; ``None`` when the step did not happen."""

    queue_ms: float | None = Field(description="wait for the model")
    ttft_ms: float | None = Field(description="request arrival (the server's first sight of the HTTP "
                                  "request, or the CLI call) to the first token with text")
    tpot_ms: float | None = Field(description="mean gap between later tokens")
    retrieval_ms: float | None = Field(description="query embedding + search + fetch")
    overhead_ms: float | None = Field(description="arrival to the plan (auth, body parsing, "
                                      "validation, retrieval, tokenisation)")
    total_ms: float | None = Field(description="arrival to the end of the answer")
    auth_ms: float | None = Field(None, description="the API key check (None: auth off, or the CLI)")
    planning_ms: float | None = Field(None, description="prompt building and the plan")
    prefill_ms: float | None = Field(None, description="model granted to the first token with text "
                                     "(prefill and the first decode step)")


class TokenCounts(BaseModel):
    """Token counts: ``prompt == cached + computed``; ``output`` generated tokens."""

    prompt: int
    cached: int = Field(description="prompt tokens served from the prefix KV cache")
    computed: int = Field(description="prompt tokens prefilled")
    output: int


class Answer(BaseModel):
    """One answered question: text, the plan's choice, predicted vs measured TTFT, receipt id.

    ``within_budget`` is measured ``ttft_ms <= ttft_budget_ms`` (``None`` when no
    token came). ``receipt_status`` says what became of the receipt by the time the answer
    ended: ``written`` (in the chain as ``receipt_id``), ``pending`` (the database could not
    take it; spooled durably, it is appended as ``receipt_id`` once the database is back, and
    ``GET /v1/receipts/{receipt_id}`` answers 404 until then) or ``failed`` (neither the chain
    nor the spool took it; see :meth:`app.answering.receipt.AnswerReceipts.deliver`).
    ``receipt_error`` says why when it is not ``written``.
    """

    status: AnswerStatus
    error: AnswerError | None
    text: str
    question: str
    ttft_budget_ms: float
    within_budget: bool | None
    budget_miss_cause: str | None = Field(None, description="when over budget: prefill (the "
                                          "prefill ran past its planned p95 by more than the plan "
                                          "was over when the model was free: misprediction), else "
                                          "queue (the wait ate it) or overhead (auth, parsing, "
                                          "retrieval, planning)")
    revision: int
    chosen_k: int
    binding: str = Field(description="why k stopped: budget, context_window, "
                                     "candidates_exhausted, nothing_fits or arrivals (room left "
                                     "for requests that arrived meanwhile)")
    predicted: PredictedTTFT
    timings: AnswerTimings
    tokens: TokenCounts
    citations: list[Citation]
    receipt_id: str | None
    finish_reason: FinishReason = Field(description="stop (a stop string or the end of sequence), "
                                                    "length (max tokens), cancelled or error")
    stop_sequence: str | None = Field(None, description="the stop string that ended the answer")
    receipt_error: str | None = None
    receipt_status: Literal["written", "pending", "failed"] = Field(
        "failed", description="written (in the chain), pending (spooled while the database is "
        "away; appended as receipt_id once it is back) or failed (no receipt with the output)")


class PlanRowPublic(BaseModel):
    """One candidate ``k`` of a plan (see :class:`latency_model.planner.PlanRow`); times in ms."""

    k: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    ttft_p50_ms: float = Field(description="predicted prefill p50 (overhead not included)")
    ttft_p95_ms: float = Field(description="predicted prefill p95 (overhead not included)")
    fits_budget: bool
    fits_context: bool


class PlanPublic(BaseModel):
    """A plan: the per-k table, the chosen ``k`` and why (see :class:`latency_model.planner.Plan`).

    ``budget_used_fraction`` = (chosen row's p95 + overhead) / budget; ``None`` when nothing fits.
    """

    rows: list[PlanRowPublic]
    chosen_k: int | None
    binding: str
    min_feasible_budget_ms: float | None
    budget_ms: float
    overhead_ms: float
    max_new_tokens: int
    context_window: int
    profile_id: str
    profile_source: str
    message: str
    budget_used_fraction: float | None

    @classmethod
    def of(cls, plan: Plan) -> PlanPublic:
        """The public form of a planner :class:`~latency_model.planner.Plan`."""
        return cls.model_validate(plan.to_dict())


class ProfileRef(BaseModel):
    """The latency profile a plan came from."""

    id: str
    source: str = Field(description="fitted or prior")


class AdviceTimings(BaseModel):
    """Measured times of an advise call, ms."""

    retrieval_ms: float
    planning_ms: float
    overhead_ms: float = Field(description="arrival to the plan (the overhead the plan adds)")
    auth_ms: float | None = Field(None, description="the API key check (None: auth off, or the CLI)")


class Advice(BaseModel):
    """``POST /v1/advise``: the per-k table, the choice, the profile; nothing generated."""

    question: str
    ttft_budget_ms: float
    revision: int
    plan: PlanPublic
    profile: ProfileRef
    candidates: list[Citation]
    prompt_tokens: int = Field(description="prompt tokens at the chosen k")
    scaffold_cached: bool
    timings: AdviceTimings
    predicted_wait_ms: float = Field(0.0, description="the queue's predicted wait now, ms (counted "
                                     "in the plan's overhead when late binding is on)")
    queue_depth: int = Field(0, description="requests waiting for the model now")
    late_binding: bool = Field(True, description="an answer would choose k again when it gets the model")
    correction: dict[str, Any] | None = Field(None, description="the profile's online correction "
                                              "(latency_model.correction.CorrectionState), None when off")
    engine_id: str | None = Field(None, description="the engine an answer would be routed to now "
                                  "('default' when one engine is configured)")
    fleet: dict[str, Any] | None = Field(None, description="the fleet planner's choice: the engine, k, "
                                         "whether it fits, and every engine's prediction for that k "
                                         "(latency_model.fleet.FleetChoice)")


class AdviceCurve(BaseModel):
    """``GET /v1/advise/curve``: the rows of :class:`Advice` for a chart, with the choice."""

    model_config = ConfigDict(extra="forbid")

    question: str
    ttft_budget_ms: float
    revision: int
    profile: ProfileRef
    rows: list[PlanRowPublic]
    chosen_k: int | None
    binding: str

    @classmethod
    def of(cls, advice: Advice) -> AdviceCurve:
        """The curve of an :class:`Advice`."""
        return cls(question=advice.question, ttft_budget_ms=advice.ttft_budget_ms,
                   revision=advice.revision, profile=advice.profile, rows=advice.plan.rows,
                   chosen_k=advice.plan.chosen_k, binding=advice.plan.binding)
