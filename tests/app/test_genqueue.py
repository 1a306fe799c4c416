import threading
import time

import pytest

from app.answering.genqueue import Cancelled, GenerationQueue
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


def test_predicted_and_least_wait_count_the_running_and_waiting_tickets():
    from app.answering.genqueue import Ticket

    q = GenerationQueue(queue_max=5)
    running = Ticket(prefill_ms=100.0, tpot_ms=10.0, max_new_tokens=5)
    waiting = Ticket(prefill_ms=50.0, tpot_ms=10.0, max_new_tokens=3)
    gate = threading.Event()
    entered = threading.Event()

    def holder():
        with q.slot(ticket=running):
            entered.set()
            gate.wait(5)

    def waiter():
        with q.slot(ticket=waiting):
            pass

    t0 = threading.Thread(target=holder)
    t0.start()
    assert entered.wait(5)
    assert q.predicted_wait_ms() == 100.0 + 4 * 10.0 and q.min_wait_ms() == 100.0
    running.produced = 2  # two tokens out: three steps left, and it might stop now
    assert q.predicted_wait_ms() == 3 * 10.0 and q.min_wait_ms() == 0.0
    t1 = threading.Thread(target=waiter)
    t1.start()
    while q.depth < 1:
        time.sleep(0.001)
    assert q.predicted_wait_ms() == 3 * 10.0 + 50.0 + 2 * 10.0
    assert q.min_wait_ms() == 50.0
    gate.set()
    t0.join(5)
    t1.join(5)
    assert q.predicted_wait_ms() == 0.0


def test_several_slots_run_together_and_the_next_waits_in_order():
    q = GenerationQueue(queue_max=2, slots=2)
    gate = threading.Event()
    inside: list[int] = []

    def holder(i: int):
        with q.slot():
            inside.append(i)
            gate.wait(5)

    threads = [threading.Thread(target=holder, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    while len(inside) < 2:
        time.sleep(0.001)
    assert q.depth == 0 and q.predicted_wait_ms() >= 0
    third = threading.Thread(target=holder, args=(2,))
    third.start()
    while q.depth < 1:
        time.sleep(0.001)
    assert inside == [0, 1] or inside == [1, 0]  # the third waits for a free slot
    gate.set()
    for t in [*threads, third]:
        t.join(5)
    assert sorted(inside) == [0, 1, 2] and q.depth == 0 and not q.busy


def test_a_free_slot_means_no_predicted_wait():
    from app.answering.genqueue import Ticket

    q = GenerationQueue(queue_max=1, slots=2)
    with q.slot(ticket=Ticket(prefill_ms=100.0, tpot_ms=10.0, max_new_tokens=5)):
        assert q.predicted_wait_ms() == 0.0 and q.min_wait_ms() == 0.0
    with pytest.raises(ValueError):
        GenerationQueue(queue_max=1, slots=0)


def test_retry_after_is_the_wait_when_full_else_the_first_running_answer_to_end():
    from app.answering.genqueue import Ticket

    q = GenerationQueue(queue_max=1, slots=2)
    assert q.retry_after_ms() == 0.0  # nothing runs
    long = Ticket(prefill_ms=100.0, tpot_ms=10.0, max_new_tokens=31)  # 100 + 30 * 10 ms
    short = Ticket(prefill_ms=50.0, tpot_ms=10.0, max_new_tokens=11)  # 50 + 10 * 10 ms
    with q.slot(ticket=long):
        # A free place: no wait, but the batch it would join shrinks when the long one ends.
        assert q.predicted_wait_ms() == 0.0 and q.retry_after_ms() == 400.0
        with q.slot(ticket=short):
            # Full: the predicted wait (both remaining, over two places) is what it says.
            assert q.retry_after_ms() == q.predicted_wait_ms() == (400.0 + 150.0) / 2
        long.produced = 21  # ten steps left
        assert q.retry_after_ms() == 100.0
    assert q.retry_after_ms() == 0.0
