"""The embedder on an optimised runtime (ONNX Runtime or OpenVINO), and the backend factory.

:class:`RuntimeEmbedder` runs the encoder graph exported by
:mod:`retrieval.embedding_export` and does the rest of the sentence-transformers
pipeline in NumPy, the way sentence-transformers' own ONNX/OpenVINO backends do:

* tokenise with the model directory's tokenizer (``transformers.AutoTokenizer``,
  lower-casing and ``max_seq_length`` from ``sentence_bert_config.json``,
  padding to the longest text of the batch, truncation at ``max_seq_length``
  word pieces), texts of one call ordered by descending length (stable) as
  ``SentenceTransformer.encode`` orders them;
* pool as ``1_Pooling/config.json`` says (mean over the attention mask, or the
  ``[CLS]`` token) in float32, then L2-normalise (``v / max(|v|, 1e-12)``, as
  ``torch.nn.functional.normalize``).

The ``onnx`` backend runs the graph after ONNX Runtime's BERT fusions
(``model-fused.onnx``: fused multi-head ``Attention``, ``SkipLayerNormalization``,
``BiasGelu``), OpenVINO the plain traced graph (it fuses at compile time).

Determinism: the runtime's threads and graph settings are pinned and recorded
in the identity (ONNX Runtime: ``intra_op_num_threads``, one inter-op thread,
sequential execution, ``ORT_ENABLE_ALL``, deterministic compute; OpenVINO: one
stream, ``INFERENCE_NUM_THREADS``, float32 inference precision and the
``ACCURACY`` execution mode, so a CPU with bf16 units never silently computes
in bf16). The identity also holds the sha256 of the exported graph file, the
runtime and tokenizer library versions, the backend and the quantisation, so
vectors of two backends (or two exports) never share an ``embedder_id``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, cast

import numpy as np

from foundation.errors import BackendError, InvalidConfig
from retrieval.embedding import (
    Embedder,
    _config_files,
    _files_hash,
    default_model_id,
    embedder_id_for,
    weights_files,
)

BACKENDS = ("torch", "onnx", "openvino")
QUANTIZATIONS = ("none", "int8")
# Document batch size per backend when the settings leave it open. The runtimes embed each
# text alone: no padding, and a text's vector is a function of that text only (ONNX
# Runtime's dynamic int8 takes one activation scale per input tensor, so in a batch a
# vector would depend on its batch mates); on 2 cores this is also their fastest setting
# (docs/benchmarks.md, "Embedder backends"). torch keeps sentence-transformers' 32.
DEFAULT_BATCH_SIZE = {"torch": 32, "onnx": 1, "openvino": 1}
# Quantisation per backend for ``auto``: int8 where the runtime has it and it met the
# quality bar on the 3 015 book-index queries (docs/benchmarks.md).
DEFAULT_QUANTIZATION = {"torch": "none", "onnx": "int8", "openvino": "none"}


def default_batch_size(backend: str) -> int:
    """Documents per forward pass for ``backend`` when not set (see ``DEFAULT_BATCH_SIZE``).

    Raises:
        InvalidConfig: unknown backend.
    """
    if backend not in DEFAULT_BATCH_SIZE:
        raise InvalidConfig(f"unknown embedder backend {backend!r} (one of {', '.join(BACKENDS)})")
    return DEFAULT_BATCH_SIZE[backend]


def resolve_quantization(backend: str, quantization: str) -> str:
    """``none``/``int8`` for ``backend``; ``auto`` picks ``DEFAULT_QUANTIZATION[backend]``.

    Raises:
        InvalidConfig: unknown backend or quantisation.
    """
    if backend not in DEFAULT_QUANTIZATION:
        raise InvalidConfig(f"unknown embedder backend {backend!r} (one of {', '.join(BACKENDS)})")
    if quantization == "auto":
        return DEFAULT_QUANTIZATION[backend]
    if quantization not in QUANTIZATIONS:
        raise InvalidConfig(f"unknown embedder quantization {quantization!r} (auto, none or int8)")
    return quantization
ORT_GRAPH_OPTIMIZATION = "ORT_ENABLE_ALL"


def _sentence_transformer_config(model_dir: Path) -> dict[str, Any]:
    """Max sequence length, lower-casing, pooling mode and normalisation of a sentence-transformers dir.

    Raises:
        InvalidConfig: a pooling mode other than mean or CLS, or no pooling module.
    """
    def read(name: str) -> dict[str, Any]:
        p = model_dir / name
        return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}

    st_conf = read("sentence_bert_config.json")
    modules = json.loads((model_dir / "modules.json").read_text(encoding="utf-8")) \
        if (model_dir / "modules.json").is_file() else []
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    if "Pooling" not in kinds:
        raise InvalidConfig(f"embedder {model_dir}: modules.json has no Pooling module")
    pooling = read(f"{kinds['Pooling']}/config.json")
    modes = [k for k in ("pooling_mode_mean_tokens", "pooling_mode_cls_token", "pooling_mode_max_tokens",
                         "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                         "pooling_mode_lasttoken") if pooling.get(k)]
    mode = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}.get(modes[0]) \
        if len(modes) == 1 else None
    if mode is None:
        raise InvalidConfig(f"embedder {model_dir}: pooling {modes or 'none'} is not supported on the "
                            "onnx/openvino backends (mean or cls only); use embedder_backend=torch")
    return {"max_seq_length": int(st_conf.get("max_seq_length") or 0),
            "do_lower_case": bool(st_conf.get("do_lower_case", False)),
            "pooling": mode, "dim": int(pooling.get("word_embedding_dimension") or 0)}


def _lowercase_first(tokenizer: Any) -> None:
    """Put a Lowercase normaliser first unless one is there, as sentence-transformers does for
    ``do_lower_case`` (a ``BertNormalizer(lowercase=True)`` does not count there either)."""
    from tokenizers.normalizers import Lowercase, Sequence

    backend = tokenizer.backend_tokenizer
    current: Any = backend.normalizer
    inner: list[Any] = list(cast(Any, current)) if isinstance(current, Sequence) else []
    if isinstance(current, Lowercase) or any(isinstance(n, Lowercase) for n in inner):
        return
    parts: list[Any] = [Lowercase(), *inner]
    if current is not None and not isinstance(current, Sequence):
        parts.append(current)
    backend.normalizer = Sequence(parts)


class _OnnxRuntimeRunner:
    """One ONNX Runtime CPU session with pinned threads and graph settings."""

    def __init__(self, graph: Path, threads: int) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, ORT_GRAPH_OPTIMIZATION)
        so.use_deterministic_compute = True
        so.log_severity_level = 3
        # Idle intra-op threads sleep instead of spinning: in this process torch (the generator)
        # runs right after a query embedding, and spinning threads would take its cores.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.settings = {"runtime": "onnxruntime", "runtime_version": ort.__version__,
                         "provider": "CPUExecutionProvider", "intra_op_threads": threads,
                         "inter_op_threads": 1, "execution_mode": "sequential",
                         "graph_optimization_level": ORT_GRAPH_OPTIMIZATION, "deterministic_compute": True,
                         "allow_spinning": False}

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        out = self.session.run(None, {k: feeds[k] for k in self.inputs})[0]
        return np.asarray(out, dtype=np.float32)


class _OpenVINORunner:
    """One OpenVINO CPU compiled model: one stream, pinned threads, float32 precision."""

    def __init__(self, graph: Path, threads: int) -> None:
        import openvino as ov

        self.config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1",
                       "INFERENCE_NUM_THREADS": str(threads), "INFERENCE_PRECISION_HINT": "f32",
                       "EXECUTION_MODE_HINT": "ACCURACY", "ENABLE_CPU_PINNING": "NO"}
        core = ov.Core()
        self.compiled = core.compile_model(core.read_model(str(graph)), "CPU", self.config)
        self.request = self.compiled.create_infer_request()
        self.inputs = [p.get_any_name() for p in self.compiled.inputs]
        precision = str(self.compiled.get_property("INFERENCE_PRECISION_HINT")).lower()
        if "f32" not in precision and "float32" not in precision:
            raise BackendError(f"OpenVINO compiled the embedder in {precision}, not f32")
        self.settings = {"runtime": "openvino", "runtime_version": ov.get_version().split("-")[0],
                         "ov_device": "CPU", **{k.lower(): v for k, v in self.config.items()}}

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        res = self.request.infer({k: feeds[k] for k in self.inputs}, share_inputs=False)
        return np.array(res[self.compiled.output(0)], dtype=np.float32, copy=True)


class RuntimeEmbedder:
    """A sentence-transformers model on ONNX Runtime (``onnx``) or OpenVINO (``openvino``), CPU.

    Args:
        path: local sentence-transformers directory (the source of the export).
        backend: ``"onnx"`` or ``"openvino"``.
        export_root: where exported graphs live (``<data_dir>/models`` by default in the app);
            the export runs once, offline, on first use.
        batch_size: documents per forward pass (fixed; part of the identity).
        threads: the runtime's intra-op threads (fixed; part of the identity).
        quantization: ``"none"`` or ``"int8"`` (dynamic int8; ``onnx`` only).
        model_id: portable model name for the identity (default: from the path).

    Raises:
        InvalidConfig: not a model directory, an unsupported pooling or backend,
            int8 on OpenVINO, or the runtime package is missing.
    """

    def __init__(self, path: str, backend: str, export_root: Path, batch_size: int = 32,
                 threads: int = 2, quantization: str = "none", model_id: str | None = None) -> None:
        import tokenizers
        import transformers

        from retrieval.embedding_export import (
            OPENVINO_XML,
            PLAIN_ONNX,
            ensure_onnx,
            ensure_openvino,
            export_dir,
            file_sha256,
        )

        if backend not in ("onnx", "openvino"):
            raise InvalidConfig(f"RuntimeEmbedder backend must be onnx or openvino, not {backend!r}")
        if quantization not in QUANTIZATIONS:
            raise InvalidConfig(f"unknown embedder quantization {quantization!r} (none or int8)")
        if backend == "openvino" and quantization != "none":
            raise InvalidConfig("embedder_quantization=int8 is available on the onnx backend only")
        model_dir = Path(path).expanduser()
        weights = weights_files(model_dir) if model_dir.is_dir() else []
        if not weights:
            raise InvalidConfig(f"embedder path {model_dir} is not a model directory with weights")
        conf = _sentence_transformer_config(model_dir)
        self.path = model_dir
        self.backend = backend
        self.quantization = quantization
        self.batch_size = int(batch_size)
        self.threads = int(threads)
        self.pooling = conf["pooling"]
        self._lock = threading.Lock()
        name = model_id or default_model_id(model_dir)
        weights_sha = _files_hash(model_dir, weights)
        try:
            if backend == "onnx":
                graph = ensure_onnx(model_dir, export_root, name, weights_sha, quantization)
                files = [graph.name]
            else:
                graph = ensure_openvino(model_dir, export_root, name, weights_sha)
                # The IR's XML names its constants from a per-process counter, so the identity
                # takes the ONNX graph it was converted from and the IR weights; the XML is
                # still checked against export.json.
                files = [PLAIN_ONNX, str(Path(OPENVINO_XML).with_suffix(".bin"))]
            directory = export_dir(export_root, name, weights_sha)
            # Checked against export.json before the runtime reads them.
            graph_sha = {f: file_sha256(directory, f) for f in files}
            if backend == "openvino":
                file_sha256(directory, OPENVINO_XML)
            self._run: Any = (_OnnxRuntimeRunner(graph, self.threads) if backend == "onnx"
                              else _OpenVINORunner(graph, self.threads))
        except ImportError as exc:
            raise InvalidConfig(f"embedder_backend={backend} needs its runtime package: {exc}") from exc
        self.graph = graph
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.max_seq_length = conf["max_seq_length"] or int(self.tokenizer.model_max_length)
        self.tokenizer.model_max_length = self.max_seq_length
        if conf["do_lower_case"]:
            _lowercase_first(self.tokenizer)
        self.dim = int(conf["dim"])
        if self.dim <= 0:
            self.dim = int(self._encode(["dimension probe"], 1).shape[1])
        self.identity: dict[str, Any] = {
            "model": name,
            "weights_sha256": weights_sha,
            "config_sha256": _files_hash(model_dir, _config_files(model_dir)),
            "dim": self.dim,
            "max_seq_length": self.max_seq_length,
            "normalize": True,
            "pooling": self.pooling,
            "batch_size": self.batch_size,
            "query_batch_size": 1,
            "threads": self.threads,
            "dtype": "float32",
            "device": "cpu",
            "backend": backend,
            "quantization": "int8-dynamic" if quantization == "int8" else "none",
            "graph_sha256": graph_sha,
            **self._run.settings,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        }
        self.embedder_id = embedder_id_for(self.identity)

    def _tokenize(self, texts: list[str]) -> dict[str, np.ndarray]:
        enc = self.tokenizer(texts, padding=True, truncation="longest_first", max_length=self.max_seq_length,
                             return_tensors="np", return_token_type_ids=True, verbose=False)
        return {k: np.ascontiguousarray(enc[k], dtype=np.int64)
                for k in ("input_ids", "attention_mask", "token_type_ids")}

    def _pool(self, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        if self.pooling == "cls":
            vec = hidden[:, 0, :]
        else:
            m = mask.astype(np.float32)[:, :, None]
            vec = (hidden * m).sum(axis=1, dtype=np.float32) / np.maximum(m.sum(axis=1), np.float32(1e-9))
        norm = np.sqrt((vec * vec).sum(axis=1, keepdims=True, dtype=np.float32))
        return (vec / np.maximum(norm, np.float32(1e-12))).astype(np.float32)

    def _encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        """The one forward path: ``(n, dim)`` float32 normalised vectors, input order kept."""
        order = np.argsort([-len(t) for t in texts], kind="stable")
        out: np.ndarray | None = None
        with self._lock:
            for i in range(0, len(texts), batch_size):
                idx = order[i:i + batch_size]
                feeds = self._tokenize([texts[j] for j in idx])
                vecs = self._pool(self._run(feeds), feeds["attention_mask"])
                if out is None:
                    out = np.zeros((len(texts), vecs.shape[1]), dtype=np.float32)
                out[idx] = vecs
        assert out is not None
        return out

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        """Embed chunk texts: ``(len(texts), dim)`` float32, L2-normalised, at ``batch_size``.

        Batches are formed after a stable sort by descending text length within
        this call, so the same list always gives the same batches and bits.
        """
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self._encode(list(texts), self.batch_size)

    def embed_query(self, text: str) -> tuple[np.ndarray, bool, int]:
        """Embed one query alone (batch size 1): ``((dim,) float32, truncated, n_wordpieces)``."""
        n = self.count_wordpieces(text)
        return self._encode([text], 1)[0], n > self.max_seq_length, n

    def count_wordpieces(self, text: str) -> int:
        """Word pieces of ``text`` with ``[CLS]``/``[SEP]``, not truncated."""
        with self._lock:
            enc = self.tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)
        return len(enc["input_ids"])


def build_embedder(backend: str, path: str, *, export_root: Path, batch_size: int | None = None,
                   threads: int = 2, quantization: str = "none") -> Embedder:
    """The embedder for ``backend``: ``torch`` (sentence-transformers on PyTorch), ``onnx`` or ``openvino``.

    ``batch_size``: chunk texts per forward pass; ``None``: :func:`default_batch_size`
    (1 on the runtimes, 32 on torch). ``quantization``: ``none``, ``int8`` or ``auto``
    (:func:`resolve_quantization`).

    Raises:
        InvalidConfig: unknown backend, or quantisation asked of a backend without it.
    """
    if backend not in BACKENDS:
        raise InvalidConfig(f"unknown embedder backend {backend!r} (one of {', '.join(BACKENDS)})")
    quantization = resolve_quantization(backend, quantization)
    batch_size = batch_size or default_batch_size(backend)
    if backend == "torch":
        if quantization != "none":
            raise InvalidConfig("embedder_quantization=int8 is available on the onnx backend only")
        from retrieval.embedding import SentenceTransformerEmbedder

        return SentenceTransformerEmbedder(path, batch_size=batch_size, threads=threads)
    return RuntimeEmbedder(path, backend, export_root, batch_size=batch_size, threads=threads,
                           quantization=quantization)
