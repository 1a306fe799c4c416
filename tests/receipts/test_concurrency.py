"""Concurrent answers never fork or lose the chain (threads and processes, both backends)."""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

from sqlalchemy import select

from foundation.db import read_session
from ragbudget_testing.synthetic_receipts import body
from receipts.chain import append_receipt
from receipts.models import ReceiptRow
from receipts.verify import verify_chain
from tests.receipts.workers import append_many


def _seqs(engine):
    with read_session(engine) as s:
        return list(s.scalars(select(ReceiptRow.seq).order_by(ReceiptRow.seq)))


def test_concurrent_threads_extend_one_chain(engine):
    def work(t):
        return [append_receipt(engine, body(question=f"t{t}-{i}")).id for i in range(8)]

    with ThreadPoolExecutor(max_workers=6) as pool:
        ids = [i for batch in pool.map(work, range(6)) for i in batch]
    assert len(set(ids)) == 48
    assert _seqs(engine) == list(range(1, 49))
    report = verify_chain(engine)
    assert report.ok, report.render()


def test_concurrent_processes_extend_one_chain(engine, db_url):
    append_receipt(engine, body(question="before"))
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=3, mp_context=ctx) as pool:
        futures = [pool.submit(append_many, db_url, f"p{p}", 6) for p in range(3)]
        ids = [i for f in futures for i in f.result(timeout=120)]
    assert len(set(ids)) == 18
    assert _seqs(engine) == list(range(1, 20))
    report = verify_chain(engine)
    assert report.ok, report.render()


def test_append_retries_after_a_unique_constraint_race(engine, monkeypatch):
    import uuid

    import receipts.chain as chain

    first = append_receipt(engine, body())
    real = uuid.uuid4
    calls = {"n": 0}

    class _Clash:
        hex = first.id.removeprefix("rcpt_")

    def clashing_uuid4():
        calls["n"] += 1
        return _Clash() if calls["n"] == 1 else real()

    monkeypatch.setattr(chain.uuid, "uuid4", clashing_uuid4)
    second = append_receipt(engine, body())
    assert calls["n"] == 2 and second.seq == 2
    assert verify_chain(engine).ok
