"""``ragbudget serve``: run the REST API with uvicorn (binds 127.0.0.1 unless told otherwise)."""

from __future__ import annotations

import argparse
import logging
import sys

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
    import uvicorn

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
    uvicorn.run(app, host=host, port=port, log_level="info")
    return 0
