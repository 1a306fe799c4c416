"""A tiny OpenAI-compatible streaming server on 127.0.0.1 for remote-backend tests.

Serves ``/v1/models``, ``/v1/completions`` (token-id prompts, unless disabled) and
``/v1/chat/completions`` as server-sent events, from a scripted list of text
pieces. ``raw_stream`` replaces the body with fixed bytes (e.g. a truncated stream).
``tokenize`` (a text -> ids function) makes it a text-only completions server like
llama-cpp-python's: list prompts get 422, and ``POST /extras/tokenize`` answers
with ``tokenize(text)``, with ``bos_id`` put in front when given.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeOpenAI:
    def __init__(self, pieces: list[str], *, token_ids: bool = True, raw_stream: bytes | None = None,
                 delay_s: float = 0.0, max_model_len: int = 2048, cached_tokens: int | None = None,
                 tokenize: Any = None, bos_id: int | None = None) -> None:
        self.tokenize, self.bos_id = tokenize, bos_id
        self.pieces, self.token_ids, self.raw_stream = pieces, token_ids, raw_stream
        self.delay_s, self.max_model_len, self.cached_tokens = delay_s, max_model_len, cached_tokens
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.chunks_sent = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [
                        {"id": "fake-model", "object": "model", "max_model_len": fake.max_model_len}]})
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.requests.append((self.path, body))
                if self.path == "/extras/tokenize" and fake.tokenize is not None:
                    ids = ([fake.bos_id] if fake.bos_id is not None else []) + fake.tokenize(body["input"])
                    self._json(200, {"tokens": ids})
                elif fake.tokenize is not None and self.path == "/v1/completions" \
                        and not isinstance(body.get("prompt"), str):
                    self._json(422, {"detail": "prompt must be a string"})
                elif self.path == "/v1/completions" and not fake.token_ids and fake.tokenize is None:
                    self._json(404, {"error": {"message": "only chat is served"}})
                elif self.path not in ("/v1/completions", "/v1/chat/completions"):
                    self._json(404, {"error": {"message": "not found"}})
                elif not body.get("stream"):
                    choice = {"index": 0, "text": fake.pieces[0], "finish_reason": "length"}
                    self._json(200, {"choices": [choice]})
                else:
                    self._stream(self.path.endswith("chat/completions"), body)

            def _json(self, status: int, obj: dict[str, Any]) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _send(self, obj: Any) -> None:
                payload = obj if isinstance(obj, str) else json.dumps(obj)
                self.wfile.write(f"data: {payload}\n\n".encode())
                self.wfile.flush()
                fake.chunks_sent += 1
                if fake.delay_s:
                    time.sleep(fake.delay_s)

            def _stream(self, chat: bool, body: dict[str, Any]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                if fake.raw_stream is not None:
                    self.wfile.write(fake.raw_stream)
                    return
                pieces = fake.pieces[: int(body.get("max_tokens", len(fake.pieces)))]
                try:
                    if chat:
                        self._send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "finish_reason": None}]})
                    for i, piece in enumerate(pieces):
                        last = i == len(pieces) - 1
                        choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
                        if chat:
                            choice["delta"] = {"content": piece}
                        else:
                            choice["text"] = piece
                        self._send({"choices": [choice]})
                    usage: dict[str, Any] = {"prompt_tokens": 10, "completion_tokens": len(pieces)}
                    if fake.cached_tokens is not None:
                        usage["prompt_tokens_details"] = {"cached_tokens": fake.cached_tokens}
                    self._send({"choices": [], "usage": usage})
                    self._send("[DONE]")
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)
