import threading
import time

import pytest

from app.genqueue import Cancelled, GenerationQueue
from foundation.errors import Busy


def test_full_queue_refuses_with_busy_and_retry_after():
    q = GenerationQueue(queue_max=0, retry_after_s=3)
    with q.slot(), pytest.raises(Busy) as exc, q.slot():
        pass
    assert exc.value.retry_after_s == 3
    assert exc.value.code == "busy"


def test_waiters_are_served_in_arrival_order():
    q = GenerationQueue(queue_max=5)
    order: list[int] = []
    gate = threading.Event()

    def holder():
        with q.slot():
            gate.wait(5)

    def waiter(i: int):
        with q.slot():
            order.append(i)

    t0 = threading.Thread(target=holder)
    t0.start()
    while not q.busy:
        time.sleep(0.001)
    threads = []
    for i in range(4):
        t = threading.Thread(target=waiter, args=(i,))
        t.start()
        threads.append(t)
        while q.depth < i + 1:
            time.sleep(0.001)
    gate.set()
    for t in [t0, *threads]:
        t.join(5)
    assert order == [0, 1, 2, 3]


def test_cancelled_waiter_leaves_and_frees_its_place():
    q = GenerationQueue(queue_max=1)
    gate = threading.Event()
    cancel = threading.Event()
    result: list[str] = []

    def holder():
        with q.slot():
            gate.wait(5)

    def waiter():
        try:
            with q.slot(cancel):
                result.append("ran")
        except Cancelled:
            result.append("cancelled")

    t0 = threading.Thread(target=holder)
    t0.start()
    while not q.busy:
        time.sleep(0.001)
    t1 = threading.Thread(target=waiter)
    t1.start()
    while q.depth < 1:
        time.sleep(0.001)
    with pytest.raises(Busy), q.slot():  # the line is full while the waiter waits
        pass
    cancel.set()
    t1.join(5)
    assert result == ["cancelled"]
    assert q.depth == 0
    gate.set()
    t0.join(5)
    with q.slot() as wait_ms:  # free again
        assert wait_ms >= 0
