"""Wiring replay into the app: the retriever and the prompt/regeneration hooks (CLI and API).

``receipts`` never imports ``app``; what replay needs from here (rebuilding a
prompt, regenerating) comes from :func:`replay_hooks` below. Also here: recording the
answers a killed process left unfinished, at start (:func:`record_interrupted_answers`), after
appending the receipts spooled during a database outage (:func:`drain_spool`). While the retriever
is not given, replay still runs the checks it can and marks the others ``skipped``.
"""

from __future__ import annotations

from typing import Any

from app.services import Services
from foundation.provenance import software_versions
from receipts.replay import ReplayReport, replay
from receipts.spool import SpoolDrainer


def _environment() -> dict[str, Any]:
    return {f"software.{k}": v for k, v in software_versions().items()}


def drain_spool(services: Services, drainer: SpoolDrainer | None = None) -> set[str]:
    """Append the receipts this data directory's spool holds (:mod:`receipts.spool`), once each;
    return the receipt ids still spooled (the database is still away). With ``drainer`` (the
    pipeline's), its spool is used and, when receipts are left, its background retry started.

    Never raises: a database that cannot be reached is logged and the files wait.
    """
    import logging

    from receipts.spool import SPOOL_DIRNAME, ReceiptSpool

    spool = drainer.spool if drainer is not None else ReceiptSpool(services.data_dir / SPOOL_DIRNAME)
    log = logging.getLogger("ragbudget")
    try:
        report = spool.drain(services.engine)
        if report.appended or report.already:
            log.warning("appended %d spooled receipt(s) at start (%d were in the chain already)",
                        len(report.appended), len(report.already))
    except Exception:
        log.exception("could not drain the receipt spool %s", spool.directory)
    left = spool.ids()
    if left and drainer is not None:
        drainer.kick()
    return left


def record_interrupted_answers(services: Services, drainer: SpoolDrainer | None = None) -> int:
    """Record every answer a dead process left without a receipt as ``interrupted``
    (:func:`receipts.journal.recover_interrupted`); return how many. Run when the API starts.

    First the spool is drained (:func:`drain_spool`): an answer whose finished receipt was
    spooled during a database outage gets that receipt, never an ``interrupted`` one; a
    journal row whose receipt is still spooled is left to the spool's drain.

    Never raises: a database that cannot be reached now is logged, and the journal rows
    wait for the next start (the API's own requests report the database error).
    """
    import logging

    from receipts.journal import recover_interrupted

    spooled = drain_spool(services, drainer)
    try:
        return len(recover_interrupted(services.engine, spooled=spooled))
    except Exception:
        logging.getLogger("ragbudget").exception("could not record interrupted answers at start")
        return 0


def replay_receipt(services: Services, receipt_id: str, *, regenerate: bool = False) -> ReplayReport:
    """Replay ``receipt_id`` with this process's retriever and hooks (see :func:`receipts.replay.replay`).

    Raises:
        UnknownReceipt: no receipt has that id.
    """
    rebuild_prompt, regenerate_hook = replay_hooks(services)
    return replay(
        services.engine, receipt_id, retriever=retriever_for_receipt(services, receipt_id),
        rebuild_prompt=rebuild_prompt,
        regenerate=regenerate_hook if regenerate else None,
        current_environment=_environment() if regenerate else None, want_regenerate=regenerate,
    )


def retriever_for_receipt(services: Services, receipt_id: str) -> Any:
    """The retriever that embeds queries as ``receipt_id``'s answer did.

    The configured one when its embedder id is the receipt's. Otherwise (the receipt
    predates a change of embedder backend, quantisation, batch size or threads, e.g. the
    default moving from torch to onnx int8) an embedder is rebuilt from the receipt's
    recorded identity on this machine's model files (the configured ``embedder_path``, else
    the packaged model) and used when its embedder id equals the receipt's: its vectors are
    the ones stored under that id, so the replay compares like with like. When no such
    embedder can be built, the configured retriever, and replay reports the difference.

    Raises:
        UnknownReceipt: no receipt has that id.
    """
    from receipts.chain import get_receipt_row, parse_body

    body = parse_body(get_receipt_row(services.engine, receipt_id).body)
    recorded = (body.get("embedder") or {})
    want, identity = recorded.get("id"), recorded.get("identity") or {}
    current = services.retriever
    if not want or want == services.embedder.embedder_id or not isinstance(identity, dict):
        return current
    embedder = _embedder_from_identity(services, identity)
    if embedder is None or embedder.embedder_id != want:
        return current
    from retrieval.retriever import Retriever

    return Retriever(services.engine, embedder, services.data_dir / "index")


def _embedder_from_identity(services: Services, identity: dict[str, Any]) -> Any:
    """An embedder built as ``identity`` records (backend, quantisation, batch size, threads),
    or None when this machine cannot build one (unknown backend, missing runtime or files)."""
    from foundation.errors import RagBudgetError
    from retrieval.embedding import packaged_embedder_path
    from retrieval.embedding_runtime import build_embedder

    s = services.settings
    try:
        return build_embedder(
            str(identity.get("backend", "torch")), s.embedder_path or str(packaged_embedder_path()),
            export_root=s.embedder_export_dir or services.data_dir / "models",
            batch_size=int(identity.get("batch_size") or 0) or None,
            threads=int(identity.get("threads") or identity.get("torch_threads") or s.torch_threads),
            quantization="int8" if identity.get("quantization") == "int8-dynamic" else "none")
    except (RagBudgetError, OSError, ValueError, TypeError):
        return None


def replay_hooks(services: Services) -> tuple[Any, Any]:
    """The app-side halves of replay (:func:`receipts.replay.replay`), for ``services``.

    Returns ``(rebuild_prompt, regenerate)``:

    * ``rebuild_prompt(body, hits) -> (token_ids_hash, prompt_tokens)`` rebuilds the
      prompt token for token from the recorded scaffold (looked up by hash), the
      recorded conversation (``request.messages`` before the question, format
      version 2), the cited chunks ``hits`` (rank order, texts from the stored
      document versions) laid out in their recorded prompt slots (``candidates[].slot``;
      one slot per chunk for a receipt from before slots), in the recorded order
      (``prompt.layout.slots``; rank order for a receipt without it) and the recorded question;
      a follow-up that continued its earlier turn (``prompt.conversation``) starts with that
      turn's prompt and output ids, rebuilt and verified against its receipt
      (:func:`app.answering.followup.rebuild_prompt`).
    * ``regenerate(body) -> {"token_ids", "token_ids_hash", "text", "environment"}``
      generates again with the recorded parameters (greedy unless a seed was
      recorded) on that rebuilt prompt, cut at the recorded stop strings exactly as
      the answer was (:class:`generation.stopping.StopMatcher`), on the engine the receipt
      records (``generator.engine_id``; a receipt without one: the first configured engine).

    Raises (from the hooks):
        NotFound: the recorded scaffold is not in the database; ``unknown_engine``, the
            recorded engine is no longer configured (:meth:`Services.engine_generator`).
    """
    from foundation.errors import BackendError
    from foundation.hashing import sha256_ints
    from generation.base import GenParams
    from generation.stopping import StopMatcher

    def _prompt(body: dict[str, Any], hits: list[Any]) -> Any:
        from app.answering.followup import rebuild_prompt as rebuild

        return rebuild(services, body, hits)

    def rebuild_prompt(body: dict[str, Any], hits: list[Any]) -> tuple[str, int]:
        prompt = _prompt(body, hits)
        return prompt.prompt_hash, prompt.prompt_tokens

    def regenerate(body: dict[str, Any]) -> dict[str, Any]:
        from receipts.stored import stored_hits

        hits, _problems = stored_hits(services.engine, body)
        from receipts.schema import recorded_engine

        engine_id = recorded_engine(body)
        # the engine that answered; raises unknown_engine when it is no longer configured
        gen = services.engine_generator(engine_id) if engine_id is not None else services.generator
        prompt = _prompt(body, hits)
        p = body["generator"]["params"]
        params = GenParams.from_dict({**p, "temperature": float(p["temperature"]),
                                      "top_p": float(p["top_p"])})
        stopper, events, per_event = StopMatcher(list(p.get("stop") or [])), 0, True
        recorded = (body["generator"].get("engine") or {}).get("prefill_chunk")
        # the local engine's chunk boundaries are part of what fixes its output bits
        chunk = int(recorded) if recorded and gen.identity.get("backend") == "local" else None
        # a stop leaves the stream open: leaving the block closes it, so the backend finalises its stats
        with gen.stream(prompt.ids, cached_prefix_ids=prompt.scaffold_ids, params=params,
                        messages=prompt.messages or None, prefill_chunk=chunk) as stream:
            for ev in stream:
                events += 1
                per_event = per_event and ev.token_id >= 0
                if stopper.feed(ev.text)[1]:
                    break
        stopper.flush()
        stats = stream.stats
        if stats is None:
            raise BackendError("the generator finished without reporting its output tokens")
        ids = list(stats.output_token_ids)
        if stopper.stopped and per_event:
            ids = ids[:events]  # as the answer recorded them: up to the token that completed the stop
        text = stopper.released
        ident = gen.identity
        env = {f"generator.{k}": ident.get(k) for k in ("backend", "model_id", "weights_hash", "dtype",
                                                         "device", "precision")}
        env.update({f"software.{k}": v for k, v in software_versions().items()})
        return {"token_ids": ids, "token_ids_hash": sha256_ints(ids), "text": text, "environment": env}

    return rebuild_prompt, regenerate


def _attr(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)
