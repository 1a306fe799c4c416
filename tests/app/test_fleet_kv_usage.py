"""KV-cache use of vLLM and SGLang engines, read from their ``/metrics``
(generation.remote_load) and priced as queueing when the cache is near full (app.fleet).

The metric text is in the form those servers write it (names, HELP lines and labels from
vLLM's and SGLang's "Production Metrics" docs); the fleet is the one of
tests/app/test_fleet_routing.py (fake generators, real planner).
"""

from __future__ import annotations

import http.server
import threading
import time
from typing import Any

import pytest

from app.answering.pipeline import AnswerPipeline
from app.answering.state import AnswerRequest
from app.fleet import KV_FULL_FRACTION, kv_full_load
from app.services import Services
from generation.remote_load import SlotLoad, SlotReading, parse_kv_usage, parse_queue_metrics
from tests.app.test_fleet_routing import LLAMA_METRICS, QUESTION, fleet, profiles  # noqa: F401 - fixtures

VLLM_V1 = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 12.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen2.5-7B-Instruct"} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.93
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.41
"""
VLLM_V0 = """# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
"""
SGLANG = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
"""


def test_kv_cache_use_of_vllm_and_sglang_is_read_and_llama_cpp_says_none() -> None:
    assert parse_kv_usage(VLLM_V1) == pytest.approx(0.93)  # the fullest of its engines
    assert parse_queue_metrics(VLLM_V1) == (21, 3)
    assert parse_kv_usage(VLLM_V0) == pytest.approx(0.42)
    assert parse_kv_usage(SGLANG) == pytest.approx(0.28)
    assert parse_kv_usage(LLAMA_METRICS) is None
    assert parse_kv_usage("<html>not metrics</html>") is None
    assert parse_kv_usage("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 1.7\n") == 1.0


class _Vllm(http.server.BaseHTTPRequestHandler):
    """vLLM's ``/metrics`` and no ``/slots`` (404)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path != "/metrics":
            self.send_error(404)
            return
        body = VLLM_V1.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_load_reading_carries_the_engine_s_kv_cache_use() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Vllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reading = SlotLoad(f"http://127.0.0.1:{server.server_address[1]}/v1", 0.05).read_once()
        assert reading is not None
        assert (len(reading.busy), reading.waiting) == (21, 3)
        assert reading.kv_usage == pytest.approx(0.93)
    finally:
        server.shutdown()


def test_a_near_full_kv_cache_fills_the_engine_s_slots_with_its_running_work() -> None:
    assert KV_FULL_FRACTION == 0.9
    assert kv_full_load([100.0, 300.0], None, 8) == [100.0, 300.0]
    assert kv_full_load([100.0, 300.0], 0.5, 8) == [100.0, 300.0]
    assert kv_full_load([100.0, 300.0], 0.95, 4) == [100.0, 300.0, 200.0, 200.0]
    assert kv_full_load([100.0] * 5, 0.99, 4) == [100.0] * 5
    assert kv_full_load([], 0.99, 4) == []


def test_an_engine_near_full_kv_use_is_priced_as_queueing_though_it_has_free_slots(
        fleet: Services) -> None:  # noqa: F811 - fixture
    pipe = AnswerPipeline(fleet)
    fast = pipe.engines["fast"]
    pipe.prepare(AnswerRequest(QUESTION, ttft_budget_ms=60_000.0))  # starts its background reader
    assert fast.load is not None
    fast.sync_slots()
    fast.queue.slots = 4  # a server that batches four sequences
    tpot = fast.profile().predict_tpot_ms(8192 // 2)
    default_new = fleet.settings.default_max_new_tokens
    try:
        # one sequence of another client's running; its cache half used: three slots free
        fast.load._reading = SlotReading(total=0, busy=[(0, -1)], t=time.perf_counter(), kv_usage=0.5)
        assert fast.predicted_wait_ms() == 0.0 and fast.queue.engine_wait_ms() == 0.0
        # the same sequence, its cache nearly full: a new request waits for a running one to end
        fast.load._reading = SlotReading(total=0, busy=[(0, -1)], t=time.perf_counter(), kv_usage=0.96)
        assert fast.predicted_wait_ms() == pytest.approx(default_new * tpot)
        assert fast.queue.engine_wait_ms() == pytest.approx(default_new * tpot / 4)
        assert fast.status()["engine_kv_usage"] == pytest.approx(0.96)
    finally:
        fast.load._reading = None
