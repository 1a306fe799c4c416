"""A real server process over fake models, for shutdown tests: ``python -m tests.api.fake_server
ROOT PORT [DATABASE_URL]``. The generator streams a long reply slowly (``TOKEN_S`` per token), so
answers are in flight when the test signals the process. Auth is off; the database is SQLite under
ROOT unless DATABASE_URL is given. Started again on the same ROOT and database it serves the same
corpus (the document is unchanged). Served through ``app.cli.serve_cmds.run_server``, the function
``ragbudget serve`` uses (``RAGBUDGET_SHUTDOWN_GRACE_S`` applies; the app's start records the
answers a killed predecessor left as ``interrupted``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from app.api.app import create_app
from app.cli.serve_cmds import run_server
from generation.base import TokenEvent, TokenStream
from latency_model.calibration import calibrate
from latency_model.grid import quick_grid
from tests.api.conftest import SENTINEL, api_settings, make_services
from tests.api.fakes import CharTokenizer, EchoGenerator, wrapped
from tests.latency_model.conftest import FakeTimer

TOKEN_S = 0.05


class SlowGenerator(EchoGenerator):
    """:class:`EchoGenerator` that sleeps ``TOKEN_S`` before each token; like the local engine,
    it runs up to ``max_running`` answers at once."""

    max_running = 3

    def stream(self, *args: Any, **kwargs: Any) -> TokenStream:
        def events(inner: TokenStream) -> Iterator[TokenEvent]:
            for event in inner:
                time.sleep(TOKEN_S)
                yield event

        return wrapped(super().stream(*args, **kwargs), events)


def main() -> None:
    root, port = Path(sys.argv[1]), int(sys.argv[2])
    db = {"database_url": sys.argv[3]} if len(sys.argv) > 3 else {}
    settings = api_settings(root, auth_enabled=False, **db)
    profile = calibrate(FakeTimer(), grid=quick_grid(8192, [200]), seed=3, progress=False)
    tokenizer = CharTokenizer()
    services = make_services(settings, profile, SlowGenerator(tokenizer, reply="slow answer " * 100))
    from fastapi.testclient import TestClient

    app = create_app(services=services)
    with TestClient(app) as client:
        r = client.post("/v1/documents", json={"id": "pump.txt", "text": SENTINEL})
        assert r.status_code in (200, 201), r.text
    run_server(create_app(services=services), settings, "127.0.0.1", port)


if __name__ == "__main__":
    main()
