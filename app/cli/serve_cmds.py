"""``ragbudget serve``: run the REST API with uvicorn (binds 127.0.0.1 unless told otherwise)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from app.auth import active_key_count, create_key

log = logging.getLogger("ragbudget")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``serve`` to the top-level subparsers ``sub``."""
    s = sub.add_parser("serve", help="run the REST API (uvicorn)")
    s.add_argument("--host", default=None, help="bind address (default: settings.host, 127.0.0.1)")
    s.add_argument("--port", type=int, default=None, help="port (default: settings.port, 8000)")
    s.add_argument("--no-preload", action="store_true", help="load models on first request")
    s.set_defaults(func=cmd_serve)


def bootstrap_admin_key(services) -> str | None:  # type: ignore[no-untyped-def]
    """On first start with auth on and no active key, create an admin key and return it (once)."""
    if not services.settings.auth_enabled or active_key_count(services.engine) > 0:
        return None
    _principal, key = create_key(services.engine, "admin", "bootstrap admin")
    return key


def cmd_serve(args: argparse.Namespace, services) -> int:  # type: ignore[no-untyped-def]
    """``ragbudget serve``: run the REST API under uvicorn until interrupted.

    Binds ``--host``/``--port`` (default: the settings, 127.0.0.1:8000); on a first start with
    auth on and no active key, creates an admin key and prints it once on stderr; loads the
    models, index and prefix cache before the first request unless ``--no-preload``.
    Returns 0 when the server stops.
    """

    from app.api.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # faiss logs each SIMD build it fails to import at INFO; the one it loads is in the index files.
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    host = args.host or services.settings.host
    port = args.port or services.settings.port
    key = bootstrap_admin_key(services)
    if key:
        print("No API key existed; created an admin key. It is shown once, store it now:\n"
              f"  {key}", file=sys.stderr, flush=True)
    app = create_app(services=services)
    if not args.no_preload:
        app.state.pipeline.warm()  # load models, index and prefix cache before the first request
    run_server(app, services.settings, host, port)
    return 0


RECEIPT_WAIT_S = 0.75  # after the grace: how long cancelled answers get to write their receipts


def run_server(app: Any, settings: Any, host: str, port: int) -> None:
    """Serve ``app`` with uvicorn until SIGTERM/SIGINT, then shut down within a bound.

    On the signal uvicorn stops accepting connections and waits for requests in flight;
    after ``settings.shutdown_grace_s`` seconds it cancels those still running. A
    cancelled streaming answer sets its cancel event (``app.api.streaming``), the
    pipeline ends it and appends a receipt with status ``cancelled``. Once uvicorn has
    stopped, every answer still in a worker thread (running, or waiting for the model) is
    cancelled and given up to ``RECEIPT_WAIT_S`` seconds to write its receipt
    (:func:`app.api.streaming.finish_answers`); then a SIGTERM is raised again with its
    default action, so the exit status says how the process ended. Without the bound an
    orchestrator's kill timeout would turn a long answer's shutdown into SIGKILL and lose
    its receipt.
    """
    import signal
    import threading

    import uvicorn

    from app.api.http_protocol import EnvelopeH11Protocol
    from app.api.streaming import finish_answers

    # uvicorn restores the handlers it found and raises the captured signal again once it has
    # stopped (uvicorn.server.Server.capture_signals). With the default SIGTERM handler that
    # kills the process right there, before the cancelled answers below write their receipts.
    # So the handlers it finds are ours: they only record the signal, which is raised again
    # with the default action once the receipts are written.
    received: list[int] = []
    handled = (signal.SIGINT, signal.SIGTERM)
    main_thread = threading.current_thread() is threading.main_thread()  # signals: main thread only
    previous = ({sig: signal.signal(sig, lambda sig, _frame: received.append(sig)) for sig in handled}
                if main_thread else {})
    try:
        # proxy_headers off: forwarded headers are believed from RAGBUDGET_TRUSTED_PROXIES alone
        # (app.api.proxy), never from uvicorn's own default (127.0.0.1).
        uvicorn.run(app, host=host, port=port, log_level="info", http=EnvelopeH11Protocol,
                    proxy_headers=False, timeout_graceful_shutdown=int(settings.shutdown_grace_s))
        left = finish_answers(RECEIPT_WAIT_S)
        if left:
            logging.getLogger(__name__).warning("%d answers did not end within %.2f s of shutdown; "
                                                "their receipts may be missing", left, RECEIPT_WAIT_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signal.SIGTERM in received:  # exit as a process stopped by SIGTERM would (status 143 in a shell)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
