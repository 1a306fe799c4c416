"""The state of one answer as it moves through :class:`app.answering.pipeline.AnswerPipeline`: the request,
what was decided before generation (:class:`Prepared`), what the stream produced so far
(:class:`InFlight`), and the events a caller streams (:class:`AnswerEvent`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.answering.types import Answer, AnswerError, AnswerStatus, PredictedTTFT
from app.prompting.conversation import Turn
from generation.base import GenerationStats

if TYPE_CHECKING:
    from app.models import Scaffold
    from app.prompting.prompt import Prompt
    from latency_model.correction import CorrectionState
    from latency_model.planner import Plan, PrefillBand
    from latency_model.profile import Profile
    from retrieval.retriever import RetrievalResult


@dataclass
class AnswerSwitches:
    """The answer path's switches, one object shared by the pipeline and every engine's
    :class:`app.answering.bands.PlanBands`, read on every use: flipped at run time for an A/B in
    one process (``benchmarks/load.py``, ``benchmarks/fleet.py``). Defaults from the settings
    (:meth:`of`).

    ``late_binding``: choose k again when the model is free; ``online_correction``: plan under
    the learned correction; ``live_speed``: scale it to the machine's speed now;
    ``residual_band``: its p95 from served answers' residuals once there are enough
    (:mod:`latency_model.correction`), else the earlier fitted-spread floor;
    ``room_for_arrivals``: leave the requests arrived meanwhile room to answer;
    ``prompt_layout``: the order the chosen chunks are shown in (:mod:`app.prompting.layout`);
    ``follow_up_layout``: ``earlier_turn`` (a follow-up continues its earlier turn's exact ids,
    :mod:`app.answering.followup`) or ``text`` (the history as text turns);
    ``routing``: ``joint`` (the fleet planner's engine and k), or a baseline a fleet benchmark
    compares it with, ``round_robin`` or ``least_ttft``, each at ``fixed_k`` when set.
    """

    late_binding: bool = True
    online_correction: bool = True
    live_speed: bool = True
    residual_band: bool = False
    room_for_arrivals: bool = True
    prompt_layout: str = "rank"
    follow_up_layout: str = "earlier_turn"
    routing: str = "joint"
    fixed_k: int | None = None

    @classmethod
    def of(cls, settings: Any) -> AnswerSwitches:
        """The switches as ``settings`` (:class:`app.settings.Settings`) set them."""
        return cls(late_binding=bool(settings.late_binding),
                   online_correction=bool(settings.online_correction),
                   live_speed=bool(settings.correction_live_speed),
                   residual_band=bool(getattr(settings, "correction_residual_band", False)),
                   room_for_arrivals=bool(getattr(settings, "room_for_arrivals", True)),
                   prompt_layout=str(getattr(settings, "prompt_layout", "rank")),
                   follow_up_layout=str(getattr(settings, "follow_up_layout", "earlier_turn")))


@dataclass
class AnswerRequest:
    """One question with its TTFT budget. ``revision`` None: the latest revision.

    ``history``: the chat messages before the question (system/developer messages
    and earlier turns), laid out after the scaffold and used for the retrieval
    query (:mod:`app.prompting.conversation`). ``stop``: stop strings
    (:mod:`generation.stopping`). ``user``: the client's end-user id, recorded.
    ``question_name``: the ``name`` on the question's chat message, recorded with it.
    """

    question: str
    ttft_budget_ms: float | None = None
    max_new_tokens: int | None = None
    revision: int | None = None
    k_max: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    history: list[Turn] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    user: str | None = None
    on_budget_miss: str | None = None  # "answer" | "reject"; None: the configured default
    question_name: str | None = None
    ignore_eos: bool = False  # vLLM's: go on past end-of-text to max_new_tokens (generation.base)
    min_tokens: int = 0  # vLLM's: no end-of-text before this many tokens (generation.base)


@dataclass
class Prepared:
    """Everything decided before generation: retrieval, plan, prompt.

    ``full_prompt`` holds all K candidates (the plan's token counts come from it);
    ``prompt`` holds the chosen k; ``query`` is the text retrieval embedded
    (:func:`app.prompting.conversation.retrieval_query`). ``arrival_t``/``prepared_t`` are
    ``time.perf_counter()`` seconds; ``timings_ms`` has ``retrieval_ms``,
    ``planning_ms``, ``overhead_ms`` (arrival to the plan) and ``auth_ms`` (when a key was checked).
    ``predicted_wait_ms``: the queue's predicted wait on arrival; ``queue_depth``: requests
    waiting then; ``planner_profile``: the profile the plan used (corrected or not) and
    ``correction`` its correction state (None when off); ``late_bound``: the plan was made
    again when the request got the model (:meth:`AnswerPipeline.bind`); ``granted_band``:
    the uncorrected, batch-aware prediction as it stood when the request got the model
    (what the online correction learns against, whether or not the plan was made then);
    ``engine_id``: the engine the request was routed to (``profile``, ``planner_profile``,
    ``correction``, ``scaffold_cached``, ``predicted_wait_ms`` and ``queue_depth`` are that
    engine's); ``fleet``: the fleet planner's choice on arrival
    (:meth:`latency_model.fleet.FleetChoice.to_dict`: every engine's prediction), None when
    it was not made.
    """

    request: AnswerRequest
    budget_ms: float
    max_new_tokens: int
    retrieval: RetrievalResult
    plan: Plan
    prompt: Prompt
    full_prompt: Prompt
    profile: Profile
    scaffold: Scaffold
    scaffold_cached: bool
    query: str
    arrival_t: float
    prepared_t: float
    timings_ms: dict[str, float] = field(default_factory=dict)
    predicted_wait_ms: float = 0.0
    queue_depth: int = 0
    planner_profile: PrefillBand | None = None
    correction: CorrectionState | None = None
    late_bound: bool = False
    granted_band: PrefillBand | None = None
    engine_id: str = "default"
    fleet: dict[str, Any] | None = None
    #: how the conversation was laid out (``prompt.conversation``, :mod:`app.answering.followup`)
    conversation: dict[str, Any] | None = None


@dataclass
class InFlight:
    """One answer while it generates: what the stream produced so far.

    ``first_t``/``last_t``: ``perf_counter()`` of the first token with text and of
    the latest token; ``n`` events seen; ``stats`` the generator's
    :class:`GenerationStats` of this answer (None when it never got the model);
    ``stop`` the stop string that ended it; ``ids_per_event`` every event carried
    its own token id (a local model, not a remote server's text chunks).
    """

    status: AnswerStatus = "ok"
    error: AnswerError | None = None
    text: list[str] = field(default_factory=list)
    first_t: float | None = None
    last_t: float | None = None
    n: int = 0
    queue_ms: float | None = None
    granted_t: float | None = None
    stats: GenerationStats | None = None
    stop: str | None = None
    ids_per_event: bool = True


@dataclass(frozen=True)
class Admission:
    """What is known of an answer when it gets the model, before its first token.

    ``receipt_id``: the id its journal row reserved, the id its receipt will have (None when
    the journal row could not be written; the final summary then says what became of the
    receipt). ``chosen_k``, ``binding`` and ``predicted`` are the plan it runs with (after late
    binding), as in its :class:`~app.answering.types.Answer`; ``prompt_tokens`` its prompt length
    in tokens; ``ttft_budget_ms`` the budget it was planned for.
    """

    receipt_id: str | None
    chosen_k: int
    binding: str
    predicted: PredictedTTFT
    ttft_budget_ms: float
    prompt_tokens: int


@dataclass
class AnswerEvent:
    """A streamed event. ``kind``: ``admitted`` (``admission``; once, when the answer gets the
    model, before any token), ``token`` (``text``; ``tokens``: tokens the engine streamed so
    far), ``final`` or ``error`` (``summary``)."""

    kind: str
    text: str = ""
    summary: Answer | None = None
    admission: Admission | None = None
    tokens: int = 0
