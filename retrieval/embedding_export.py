"""Export a local sentence-transformers model once, offline, to ONNX and OpenVINO IR.

sentence-transformers' own ``backend="onnx"``/``"openvino"`` path goes through
Optimum (``optimum-onnx`` / ``optimum-intel``); neither installs next to
transformers 5.x and sentence-transformers 6 (``optimum-onnx`` 0.1 wants
transformers < 4.58, ``optimum-intel`` 2.2 wants < 5.6 and torchvision). The
export here does what Optimum's feature-extraction export does for a BERT
encoder, with the libraries already installed:

1. load the model with sentence-transformers on CPU, float32, from local files,
   with transformers' ``eager`` attention (explicit MatMul/Softmax, the pattern
   ONNX Runtime's fusion recognises; the default SDPA path traces to a graph
   it cannot fuse);
2. trace its transformer (``input_ids``, ``attention_mask``, ``token_type_ids``
   -> ``last_hidden_state``) with ``torch.onnx.export`` (TorchScript exporter,
   opset :data:`ONNX_OPSET`, dynamic batch and sequence axes), from a padded
   example batch so the attention-mask path is part of the graph;
3. derived files, each made on first use:
   ``model-fused.onnx``, the plain graph through ONNX Runtime's transformer
   optimizer for BERT (``onnxruntime.transformers.optimizer.optimize_model``,
   offline fusions only: ``Attention``, ``EmbedLayerNormalization``,
   ``SkipLayerNormalization``, ``BiasGelu``; what Optimum's ``ORTOptimizer``
   runs), which is what the ``onnx`` backend runs;
   ``model-fused-int8.onnx`` (ONNX Runtime dynamic quantisation of the fused
   graph: int8 weights per channel, activations quantised per call; what
   sentence-transformers' ``export_dynamic_quantized_onnx_model`` does
   through Optimum) and ``openvino/model.xml`` + ``.bin``
   (``openvino.convert_model`` of the plain graph, saved in float32:
   ``compress_to_fp16=False``; OpenVINO does its own fusions at compile time
   and cannot read ONNX Runtime's contrib operators).

Pooling and normalisation stay outside the graph (see
:mod:`retrieval.embedding_runtime`), as in sentence-transformers' ONNX backend.

Files live in ``<export_root>/<model name>-<12 hex of the weights hash>-f<EXPORT_FORMAT>/``,
next to ``export.json`` (source model, weights hash, exporter versions, every
file's sha256). Each file is written to a temporary name and renamed, under an
advisory file lock, so concurrent processes never see half a file and export
only once. Nothing is downloaded.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from foundation.compute import on_compute_thread
from foundation.errors import InvalidConfig
from foundation.hashing import sha256_file

ONNX_OPSET = 17  # LayerNormalization is a single op from opset 17
EXPORT_FORMAT = 2  # bump when the export procedure changes (2: eager attention, fused graph)
PLAIN_ONNX = "model.onnx"
FUSED_ONNX = "model-fused.onnx"
INT8_ONNX = "model-fused-int8.onnx"
OPENVINO_XML = "openvino/model.xml"
MANIFEST = "export.json"
# Inputs of a BERT-style encoder in the order the graph takes them.
ENCODER_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
_EXAMPLE_TEXTS = ["a short example", "a longer example sentence, so that the batch is padded"]


def export_dir(export_root: Path, model_name: str, weights_sha256: str) -> Path:
    """Directory of the exported files of one source model: ``<root>/<name>-<hash12>-f<format>``.

    The export format is in the name, so files of an earlier export procedure are never reused.
    """
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in model_name).strip("-") or "model"
    return export_root / f"{safe}-{weights_sha256.split(':')[-1][:12]}-f{EXPORT_FORMAT}"


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp_dir)`` creates ``tmp_dir / target.name`` (plus siblings); then rename into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=target.parent))
    try:
        write(tmp)
        for f in sorted(tmp.iterdir()):
            os.replace(f, target.parent / f.name)
    finally:
        for f in tmp.iterdir() if tmp.exists() else []:
            f.unlink()
        if tmp.exists():
            tmp.rmdir()


def _read_manifest(directory: Path) -> dict[str, Any]:
    p = directory / MANIFEST
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}


def _record(directory: Path, source: dict[str, Any], files: list[str]) -> None:
    manifest = _read_manifest(directory)
    manifest.update({"format": EXPORT_FORMAT, "source": source})
    sums = manifest.setdefault("files", {})
    for name in files:
        sums[name] = sha256_file(directory / name)
    body = json.dumps(manifest, indent=2, sort_keys=True) + "\n"

    def write(tmp: Path) -> None:
        (tmp / MANIFEST).write_text(body, encoding="utf-8")

    _write_atomically(directory / MANIFEST, write)


def file_sha256(directory: Path, name: str) -> str:
    """The recorded ``sha256:`` of an exported file (recomputed when not recorded).

    Raises:
        IntegrityFailure: the file on disk no longer matches the recorded hash.
    """
    from foundation.errors import IntegrityFailure

    actual = sha256_file(directory / name)
    recorded = _read_manifest(directory).get("files", {}).get(name)
    if recorded is not None and recorded != actual:
        raise IntegrityFailure(f"exported embedder file {directory / name} changed since export "
                               f"(recorded {recorded}, found {actual}); delete {directory} to re-export")
    return actual


@on_compute_thread
def _export_plain(model_dir: Path, out: Path) -> None:
    """Trace the encoder of the sentence-transformers model in ``model_dir`` to ``out`` (ONNX)."""
    import warnings

    import torch
    from sentence_transformers import SentenceTransformer

    from foundation.quiet import quiet_weight_loading

    with quiet_weight_loading():
        st = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True,
                                 model_kwargs={"attn_implementation": "eager"})
    st.eval()
    first = st[0]
    encoder = getattr(first, "auto_model", None) or getattr(first, "model", None)
    if encoder is None or not hasattr(first, "tokenizer"):
        raise InvalidConfig(f"embedder {model_dir}: first module is not a transformer encoder")
    example = st.tokenizer(_EXAMPLE_TEXTS, padding=True, truncation=True, return_tensors="pt")
    missing = [k for k in ENCODER_INPUTS if k not in example]
    if missing:
        raise InvalidConfig(f"embedder {model_dir}: tokenizer gives no {missing}; only BERT-style "
                            "encoders (input_ids, attention_mask, token_type_ids) can be exported")

    class _Encoder(torch.nn.Module):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    axes = {name: {0: "batch", 1: "sequence"} for name in (*ENCODER_INPUTS, "last_hidden_state")}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Encoder(encoder).eval(), tuple(example[k] for k in ENCODER_INPUTS), str(out),
                          dynamo=False, input_names=list(ENCODER_INPUTS),
                          output_names=["last_hidden_state"], dynamic_axes=axes,
                          opset_version=ONNX_OPSET, do_constant_folding=True)


def _source(model_dir: Path, model_name: str, weights_sha256: str) -> dict[str, Any]:
    import onnxruntime
    import torch

    return {"model": model_name, "weights_sha256": weights_sha256, "torch": torch.__version__,
            "opset": ONNX_OPSET, "exporter": "torch.onnx.export(dynamo=False)", "attention": "eager",
            "optimizer": f"onnxruntime.transformers.optimizer {onnxruntime.__version__} bert opt_level=0"}


def _fuse(model_dir: Path, plain: Path, out: Path) -> None:
    """Write ``plain`` through ONNX Runtime's BERT optimizer (offline fusions, opt_level 0) to ``out``.

    Heads and hidden size come from the model's ``config.json``
    (``num_attention_heads``, ``hidden_size``).

    Raises:
        InvalidConfig: ``config.json`` names no heads or hidden size.
    """
    import logging

    from onnxruntime.transformers.optimizer import optimize_model

    conf_path = model_dir / "config.json"
    conf = json.loads(conf_path.read_text(encoding="utf-8")) if conf_path.is_file() else {}
    heads, hidden = int(conf.get("num_attention_heads") or 0), int(conf.get("hidden_size") or 0)
    if heads <= 0 or hidden <= 0:
        raise InvalidConfig(f"embedder {model_dir}: config.json names no num_attention_heads/hidden_size")
    quiet = logging.getLogger("onnxruntime.transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        model = optimize_model(str(plain), model_type="bert", num_heads=heads, hidden_size=hidden,
                               opt_level=0, use_gpu=False)
    finally:
        quiet.setLevel(level)
    model.save_model_to_file(str(out))


def ensure_onnx(model_dir: Path, export_root: Path, model_name: str, weights_sha256: str,
                quantization: str = "none", fused: bool = True) -> Path:
    """Path of the exported ONNX graph for ``model_dir``, exporting it first if absent.

    Args:
        quantization: ``"none"`` (float32 graph) or ``"int8"`` (dynamic int8 of the fused graph).
        fused: ``True`` (the ``onnx`` backend): the graph after ONNX Runtime's BERT fusions;
            ``False``: the plain traced graph (standard ONNX operators only, for OpenVINO).

    Raises:
        InvalidConfig: the model is not a BERT-style sentence-transformers encoder,
            ``quantization`` is unknown, or int8 of the plain graph is asked for.
    """
    if quantization not in ("none", "int8"):
        raise InvalidConfig(f"unknown embedder quantization {quantization!r} (none or int8)")
    if quantization == "int8" and not fused:
        raise InvalidConfig("int8 is made from the fused graph only")
    directory = export_dir(export_root, model_name, weights_sha256)
    source = _source(model_dir, model_name, weights_sha256)
    with _locked(directory):
        plain = directory / PLAIN_ONNX
        if not plain.is_file():
            _write_atomically(plain, lambda tmp: _export_plain(model_dir, tmp / PLAIN_ONNX))
            _record(directory, source, [PLAIN_ONNX])
        if not fused:
            return plain
        fused_graph = directory / FUSED_ONNX
        if not fused_graph.is_file():
            _write_atomically(fused_graph, lambda tmp: _fuse(model_dir, plain, tmp / FUSED_ONNX))
            _record(directory, source, [FUSED_ONNX])
        if quantization == "none":
            return fused_graph
        target = directory / INT8_ONNX
        if not target.is_file():
            def quantize(tmp: Path) -> None:
                from onnx import TensorProto
                from onnxruntime.quantization import QuantType, quantize_dynamic

                # ONNX shape inference does not type the outputs of ORT's fused (contrib) operators;
                # every tensor of this graph is float32.
                # quantize_dynamic logs a generic "consider pre-processing" advice on the root
                # logger on every call; the fused graph is already optimised, so it is muted.
                root = logging.getLogger()
                level = root.level
                root.setLevel(logging.ERROR)
                try:
                    quantize_dynamic(str(fused_graph), str(tmp / INT8_ONNX), per_channel=True,
                                     reduce_range=False, weight_type=QuantType.QInt8,
                                     extra_options={"DefaultTensorType": TensorProto.FLOAT})
                finally:
                    root.setLevel(level)

            _write_atomically(target, quantize)
            _record(directory, source, [INT8_ONNX])
        return target


def ensure_openvino(model_dir: Path, export_root: Path, model_name: str, weights_sha256: str) -> Path:
    """Path of the OpenVINO IR (``model.xml``; weights in ``model.bin``), converting the ONNX graph once.

    Raises:
        InvalidConfig: as :func:`ensure_onnx`, or the ``openvino`` package is not installed.
    """
    try:
        import openvino as ov
    except ImportError as exc:
        raise InvalidConfig("embedder_backend=openvino needs the openvino package") from exc
    plain = ensure_onnx(model_dir, export_root, model_name, weights_sha256, fused=False)
    directory = plain.parent
    xml = directory / OPENVINO_XML
    with _locked(directory):
        if not xml.is_file():
            def convert(tmp: Path) -> None:
                ov.save_model(ov.convert_model(str(plain)), str(tmp / xml.name), compress_to_fp16=False)

            _write_atomically(xml, convert)
            _record(directory, _source(model_dir, model_name, weights_sha256),
                    [OPENVINO_XML, str(Path(OPENVINO_XML).with_suffix(".bin"))])
    return xml
