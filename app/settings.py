"""One settings object, built by :func:`get_settings` and injected; never at import time.

Every field can be set from the environment with the ``RAGBUDGET_`` prefix
(e.g. ``RAGBUDGET_DATABASE_URL``) or a ``.env`` file in the working directory.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# An origin as browsers send it (RFC 6454): scheme, host (a '*.' prefix matches subdomains), port.
#: An engine id: what receipts, metrics and ``ragbudget calibrate --engine`` name it by.
ENGINE_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
#: The id of the one engine a server has when no engine list is configured.
DEFAULT_ENGINE_ID = "default"

_ORIGIN = re.compile(r"https?://(\*\.)?[a-z0-9.-]+(:[0-9]{1,5})?|https?://\[[0-9a-f:.]+\](:[0-9]{1,5})?")


class EngineConfig(BaseModel):
    """One engine of the fleet (``RAGBUDGET_ENGINES``, a JSON list of these; docs/deployment.md).

    ``kind`` ``local``: the model inside this process (the ``generator_*`` settings; at most
    one per list). ``remote``: an OpenAI-compatible server at ``base_url`` serving ``model``;
    ``max_running``, ``api_key``, ``tokenizer`` and ``context_window`` mean what the
    ``remote_*`` settings of the same names mean for the one remote engine (unset: the
    server's own slot count and context size; the tokenizer defaults to the
    ``remote_tokenizer`` setting, else ``model``). Every engine of a list must use the same
    tokenizer (the prompt is built once, as token ids, before the engine is chosen).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=f"^{ENGINE_ID_PATTERN}$", description="Unique engine id (letters, "
                    "digits, '_', '.', '-'; at most 64).")
    kind: Literal["local", "remote"] = "remote"
    base_url: str | None = Field(default=None, description="Remote: the API root with its version, e.g. "
                                 "http://10.0.0.21:8080/v1.")
    model: str | None = None
    max_running: int | None = Field(default=None, ge=1, le=4096)
    api_key: str | None = None
    tokenizer: str | None = None
    context_window: int | None = Field(default=None, ge=16)

    @model_validator(mode="after")
    def _remote_needs_url(self) -> EngineConfig:
        """A remote engine names its server and model; a local one neither."""
        if self.kind == "remote":
            if not self.base_url or not self.model:
                raise ValueError(f"engine {self.id!r}: a remote engine needs base_url and model")
            if not self.base_url.startswith(("http://", "https://")):
                raise ValueError(f"engine {self.id!r}: base_url must be an http:// or https:// URL")
        elif self.base_url or self.model or self.api_key or self.tokenizer:
            raise ValueError(f"engine {self.id!r}: a local engine takes no base_url, model, api_key "
                             "or tokenizer (it runs the generator_* settings' model)")
        return self


class Settings(BaseSettings):
    """ragbudget configuration. Units live in the names (``_ms``, ``_bytes``, ``_tokens``)."""

    model_config = SettingsConfigDict(env_prefix="RAGBUDGET_", env_file=".env", extra="ignore")

    # --- storage -----------------------------------------------------------
    data_dir: Path = Field(Path("ragbudget-data"), description="Where the SQLite file, FAISS "
                           "index, converted models, profiles and fetched corpora live.")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default: SQLite file "
                                     "<data_dir>/ragbudget.db. Production: postgresql+psycopg://...")
    sqlite_busy_timeout_ms: int = 60_000

    # --- embedder ------------------------------------------------------------
    embedder_path: str | None = Field(None, description="Local sentence-transformers model "
                                      "directory; default: the packaged all-MiniLM-L6-v2.")
    embedder_backend: Literal["torch", "onnx", "openvino"] = Field(
        "onnx", description="Runtime of the embedder: onnx (ONNX Runtime, the default on CPU), torch "
        "(sentence-transformers on PyTorch) or openvino; onnx/openvino export the model once, offline, "
        "under embedder_export_dir. Part of the embedder identity: switching re-embeds the corpus.")
    embedder_quantization: Literal["auto", "none", "int8"] = Field(
        "auto", description="int8: dynamic int8 quantisation of the exported graph (onnx backend only); "
        "auto: int8 on onnx, none elsewhere (int8 met the retrieval quality bar, docs/benchmarks.md).")
    embedder_export_dir: Path | None = Field(None, description="Where exported embedder graphs live; "
                                             "default <data_dir>/models.")
    embed_batch_size: int | None = Field(None, ge=1, le=1024, description="Chunk texts per forward "
                                         "pass (part of the embedder identity); default: 1 on onnx and "
                                         "openvino (each text alone: its vector depends on it only), 32 "
                                         "on torch.")
    torch_threads: int = Field(2, ge=1, le=256, description="Intra-op threads of torch and of the "
                               "embedder runtime, fixed so embeddings and timings are reproducible.")

    # --- chunking --------------------------------------------------------------
    chunk_tokens: int = Field(128, ge=8, le=8192, description="Chunk window, generator tokens.")
    chunk_overlap_tokens: int = Field(16, ge=0, le=8191)

    # --- generator -------------------------------------------------------------
    generator_backend: Literal["local", "remote"] = "local"
    generator_path: str | None = Field(None, description="Local Hugging Face model directory or a "
                                       ".gguf file (converted once to fp32 safetensors under data_dir); "
                                       "default: the packaged SmolLM2-135M-Instruct GGUF.")
    chat_template: str | None = Field(None, description="Chat template framing the prompt: a Jinja "
                                      "file, a bundled template name (gemma3, chatml), or 'plain' for the "
                                      "plain-completion layout; default: the model's own (refused when it "
                                      "has none).")
    generator_device: Literal["auto", "cpu", "cuda"] = "auto"
    generator_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    generator_precision: Literal["fp32", "bf16", "int8", "int8a16"] = Field(
        "fp32", description="Local engine on CPU: compute precision of the linear layers. bf16 runs "
        "them as bf16 GEMMs of a fixed row count (generator_tile_rows; batch-invariant, weights "
        "converted once at load; norms, attention and sampling stay fp32) and needs a CPU with "
        "avx512_bf16 or amx_bf16 (refused at start otherwise). int8 (w8a8) quantises weights per "
        "output channel and activations per row, int8 GEMMs with exact int32 sums (batch-invariant "
        "without row padding; int8a16 takes each activation row in two int8 passes, ~15 bits, for "
        "quality); needs avx512_vnni, avx_vnni or amx_int8. Part of the generator identity: "
        "receipts, the prefix cache and the latency profile are per precision (docs/precision.md).")
    generator_tile_rows: int = Field(128, ge=1, le=4096, description="Local engine, bf16: rows per "
                                     "GEMM tile (recorded in the precision's name, e.g. bf16-tile128).")
    generator_max_running: int = Field(8, ge=1, le=256, description="Local engine: answers "
                                       "decoding together at most; later ones wait in arrival order.")
    generator_step_token_budget: int = Field(256, ge=1, le=65536, description="Local engine: "
                                             "tokens per step (decode tokens + prefill chunks; one "
                                             "chunk always fits).")
    generator_prefill_chunk: int = Field(256, ge=1, le=65536, description="Local engine: prefill "
                                         "chunk size in tokens (recorded in receipts; replay reuses "
                                         "the recorded one).")
    generator_prefix_cache_mib: float = Field(256, ge=0, le=1 << 20, description="Local engine: "
                                              "memory budget of the prefix KV cache, MiB (K/V of "
                                              "token blocks shared by answers: the scaffold, "
                                              "leading chunks, earlier turns; least recently used "
                                              "leaf blocks are evicted first; 0 keeps nothing).")
    generator_warm_turns: int = Field(0, ge=0, le=256, description="Local engine: finished answers "
                                      "whose tails (prompt, output, end of turn) the engine "
                                      "prefills into the prefix cache while it has nothing else to "
                                      "run, newest first, so a follow-up loads the earlier answer "
                                      "too (docs/engines.md, 'Follow-up turns'); 0 (the default) turns it "
                                      "off: with 256-token chunks a short answer rarely fills a "
                                      "block, so it added nothing where measured; e.g. 8.")
    remote_base_url: str | None = Field(None, description="OpenAI-compatible server, e.g. "
                                        "http://127.0.0.1:8001/v1 (vLLM, SGLang).")
    remote_model: str | None = None
    remote_max_running: int | None = Field(None, ge=1, le=4096, description="Remote engine: "
                                           "requests sent at once. Unset: the server's own "
                                           "slot count (llama.cpp /props total_slots), else 1; "
                                           "set it for vLLM or SGLang, which batch.")
    remote_api_key: str | None = None
    remote_tokenizer: str | None = Field(None, description="Local HF tokenizer directory or a "
                                         "tiktoken encoding name for the remote model.")
    remote_context_window: int | None = Field(None, ge=16, description="The server's context size "
                                              "in tokens (llama.cpp: its n_ctx); default: the server's "
                                              "max_model_len from /models, else 4096.")

    engines: list[EngineConfig] | None = Field(
        None, description="The engines answers are routed over, a JSON list of objects with id, "
        "kind (local|remote), base_url, model and optionally max_running, api_key, tokenizer, "
        "context_window (RAGBUDGET_ENGINES='[{\"id\": \"gpu1\", \"base_url\": ...}]'); each "
        "answer goes to the engine and k that carry the most context within its budget "
        "(latency_model.fleet). Unset: one engine, id 'default', from generator_backend and the "
        "remote_* settings.")
    engine_probe_interval_s: float = Field(1.0, gt=0, le=3600, description="How often an engine "
                                           "taken out of rotation (connection refused) is probed, "
                                           "and how often a llama.cpp engine's /slots is read for "
                                           "the load of its other clients (seconds).")
    engine_first_token_margin_ms: float = Field(
        1000.0, ge=0, le=600_000, description="A remote engine that has sent no first token "
        "within twice the plan's predicted p95 (the engine's own queue included) plus this "
        "margin (ms) is treated as having dropped the stream: taken out of rotation and probed, "
        "the answer retried once elsewhere (app.fleet); for an answer that must make its budget "
        "(on_budget_miss: reject) the wait is also bounded by what is left of the budget.")

    # --- answers ---------------------------------------------------------------
    default_ttft_budget_ms: float = Field(1000.0, gt=0)
    default_max_new_tokens: int = Field(64, ge=1)
    retrieval_candidates: int = Field(16, ge=1, description="K: candidates retrieved per "
                                      "question; the planner picks k <= K.")
    queue_max: int = Field(8, ge=0, description="Answers waiting for the local model; more is 429.")
    prompt_layout: Literal["rank", "canonical"] = Field(
        "canonical", description="Order of the chosen chunks in the prompt (app.prompting.layout): canonical "
        "(sorted by document, version and offset, so overlapping retrievals share cached prefixes) "
        "or rank (best first). Retrieval chooses the same chunks either way; receipts record it.")
    follow_up_layout: Literal["earlier_turn", "text"] = Field(
        "earlier_turn", description="A chat follow-up whose history is exactly an earlier receipt's "
        "messages and answer: earlier_turn continues that turn's exact prompt and output token ids "
        "(so the prefix cache serves the whole previous turn, app.answering.followup); text lays the "
        "history out as text turns after the scaffold. Receipts record which was used.")
    late_binding: bool = Field(True, description="Choose k when the request gets the model, from the "
                               "budget minus the time already spent (and plan on arrival with the "
                               "predicted wait); off: k is chosen on arrival, the wait unseen.")
    room_for_arrivals: bool = Field(True, description="With late binding: an answer granted the "
                                    "model takes no more chunks than leave every request already "
                                    "arrived the prefill it needs to answer within its budget with "
                                    "k = 0 (binding 'arrivals'); off: each answer plans as if no one "
                                    "came after it.")
    online_correction: bool = Field(True, description="Correct the fitted profile's prefill "
                                    "prediction from measured prefills (latency_model.correction).")
    correction_window: int = Field(40, ge=1, le=10_000, description="Answers the online correction "
                                   "keeps (N).")
    correction_live_speed: bool = Field(True, description="Scale the online correction by the "
                                        "machine's speed read from the engine's latest steps against "
                                        "the profile's step model (seconds, not answers, to follow a "
                                        "busier or quieter machine); off: answers only.")
    correction_residual_band: bool = Field(False, description="Once the online correction holds "
                                           "19 answers (the 0.95 conformal rank), price p95 from "
                                           "their own residuals per prompt size, without the "
                                           "fitted p95/p50 spread as a floor (under-covered the "
                                           "fleet's third run, so off by default); off: the "
                                           "earlier floor (latency_model.correction).")
    on_budget_miss: Literal["answer", "reject"] = Field(
        "answer", description="When even k=0 cannot make the budget: answer anyway (flagged) or "
        "refuse with 503 budget_unreachable; a request may choose for itself.")

    # --- limits (HTTP 413/422 with a code) --------------------------------------
    max_body_bytes: int = 32 * 1024 * 1024
    max_document_bytes: int = 20 * 1024 * 1024
    max_question_chars: int = 4000
    max_k: int = 64
    max_new_tokens_limit: int = 1024
    min_budget_ms: float = 1.0
    max_budget_ms: float = 600_000.0
    max_batch_documents: int = 5000

    # --- traces (OpenTelemetry, app.tracing; docs/tracing.md) --------------------------
    otlp_endpoint: str = Field("", description="OTLP/HTTP (protobuf) traces URL every answer is "
                               "exported to as one trace, e.g. http://127.0.0.1:6006/v1/traces (Phoenix) "
                               "or http://127.0.0.1:4318/v1/traces (Jaeger, an OpenTelemetry "
                               "collector); empty: off, and OpenTelemetry is never imported.")
    otlp_headers: str = Field("", description="Headers sent with each export, as "
                              "OTEL_EXPORTER_OTLP_HEADERS writes them: key=value,key2=value2 "
                              "(Langfuse: Authorization=Basic <base64 public:secret key>).")
    otlp_service_name: str = Field("ragbudget", min_length=1, description="The traces' service.name "
                                   "and Phoenix project (openinference.project.name).")
    otlp_export_text: bool = Field(False, description="Also export the question, the retrieval "
                                   "query, each candidate chunk's text and the answer text; off: ids, "
                                   "hashes, scores, token counts and timings only (receipts may hold "
                                   "sensitive text, and a trace store is read by more people and kept "
                                   "under other rules than the receipt chain).")
    public_base_url: str | None = Field(None, description="The console's base URL as operators "
                                        "reach it (e.g. https://ragbudget.example.com), for the receipt "
                                        "link on each trace; default http://<host>:<port>.")

    # --- server and access -------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8000
    shutdown_grace_s: int = Field(10, ge=0, le=3600, description="On SIGTERM/SIGINT the server "
                                    "stops accepting, lets answers in flight finish for at most this "
                                    "long, then cancels the rest (their receipts say cancelled) and exits "
                                    "(RAGBUDGET_SHUTDOWN_GRACE_S; whole seconds, as uvicorn takes it).")
    auth_enabled: bool = True
    metrics_public: bool = True
    ui_session_idle_s: int = Field(1800, ge=60, le=7 * 86400, description="A console session ends "
                                   "after this long without a request (seconds).")
    ui_session_max_s: int = Field(12 * 3600, ge=60, le=30 * 86400, description="A console session "
                                  "ends this long after sign-in, however active (seconds).")
    trusted_proxies: str = Field("", description="Reverse proxies whose X-Forwarded-For, "
                                 "X-Forwarded-Proto and X-Forwarded-Host headers are believed: "
                                 "comma-separated IP addresses and CIDR networks of the connecting "
                                 "peer (e.g. 127.0.0.1,10.0.0.0/8), or '*' for every peer (only when "
                                 "nothing but the proxy can reach the server); empty: forwarded "
                                 "headers are ignored. docs/console.md, 'Behind a reverse proxy'.")
    trusted_origins: str = Field("", description="Origins besides the server's own that the "
                                 "console's CSRF origin check accepts, comma-separated "
                                 "scheme://host[:port] (e.g. https://ragbudget.example.com); a host "
                                 "starting with '*.' matches its subdomains (Django's "
                                 "CSRF_TRUSTED_ORIGINS).")

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_url(cls, value: str) -> str:
        """An OTLP endpoint is an http(s) URL (or empty: tracing off); refused at start otherwise."""
        value = value.strip()
        if value and not value.startswith(("http://", "https://")):
            raise ValueError(f"otlp_endpoint must be an http:// or https:// URL, got {value!r}")
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies(cls, value: str) -> str:
        """Each entry an IP address or CIDR network, or ``*`` alone; refused at start otherwise."""
        entries = split_list(value)
        if "*" in entries and len(entries) > 1:
            raise ValueError("trusted_proxies: '*' trusts every peer and cannot be combined with addresses")
        for entry in entries:
            if entry != "*":
                try:
                    ipaddress.ip_network(entry, strict=False)
                except ValueError:
                    raise ValueError(f"trusted_proxies: {entry!r} is not an IP address or CIDR network") \
                        from None
        return ",".join(entries)

    @field_validator("trusted_origins")
    @classmethod
    def _origins(cls, value: str) -> str:
        """Each entry ``http(s)://host[:port]`` with nothing after it; refused at start otherwise."""
        entries = [e.rstrip("/").lower() for e in split_list(value)]
        for entry in entries:
            if not _ORIGIN.fullmatch(entry):
                raise ValueError(f"trusted_origins: {entry!r} is not an origin "
                                 "(scheme://host[:port], e.g. https://ragbudget.example.com)")
        return ",".join(entries)

    @field_validator("engines")
    @classmethod
    def _engines(cls, value: list[EngineConfig] | None) -> list[EngineConfig] | None:
        """A non-empty list of unique ids with at most one local engine; refused at start otherwise."""
        if value is None:
            return None
        if not value:
            raise ValueError("engines: the list is empty (unset it for the one default engine)")
        ids = [e.id for e in value]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"engines: duplicate engine id(s) {dupes}")
        if sum(e.kind == "local" for e in value) > 1:
            raise ValueError("engines: at most one local engine (one model per process)")
        if any(e.kind == "local" for e in value[1:]):
            raise ValueError("engines: the local engine must come first (its tokenizer is the one "
                             "every engine shares)")
        return value

    def engine_list(self) -> list[EngineConfig]:
        """The engines in force, in configured order: :attr:`engines`, else one engine
        :data:`DEFAULT_ENGINE_ID` made from ``generator_backend`` and the ``remote_*`` settings
        (its remote fields may be unset here: :func:`app.services.build_generator` refuses that)."""
        if self.engines:
            return list(self.engines)
        if self.generator_backend == "remote":
            return [EngineConfig.model_construct(
                id=DEFAULT_ENGINE_ID, kind="remote", base_url=self.remote_base_url,
                model=self.remote_model, max_running=self.remote_max_running,
                api_key=self.remote_api_key, tokenizer=self.remote_tokenizer,
                context_window=self.remote_context_window)]
        return [EngineConfig(id=DEFAULT_ENGINE_ID, kind="local")]

    @property
    def trusted_proxy_list(self) -> list[str]:
        """:attr:`trusted_proxies` as a list (``[]``: no proxy is trusted)."""
        return split_list(self.trusted_proxies)

    @property
    def trusted_origin_list(self) -> list[str]:
        """:attr:`trusted_origins` as a list of lower-case origins without a trailing slash."""
        return split_list(self.trusted_origins)

    @property
    def resolved_database_url(self) -> str:
        """The database URL in force: explicit, else SQLite under ``data_dir``."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'ragbudget.db').resolve()}"


def split_list(value: str) -> list[str]:
    """The non-empty, stripped entries of a comma-separated setting."""
    return [e.strip() for e in value.split(",") if e.strip()]


def get_settings(**overrides: object) -> Settings:
    """Build a fresh :class:`Settings` from the environment, with keyword overrides.

    Raises:
        pydantic.ValidationError: a value is out of range or of the wrong type.
    """
    return Settings(**overrides)  # type: ignore[arg-type]
