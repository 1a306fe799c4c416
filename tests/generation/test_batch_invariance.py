"""The continuous-batching engine's batch invariance on real questions.

Twenty questions about real PostgreSQL 15 documentation pages are answered alone,
then again in mixes of 2 to 8 concurrent arrivals at random (seeded) offsets: every
question's output token ids are identical, in each compute precision (fp32, and the
tiled bf16 of generation.precision where the CPU has bf16 instructions, and int8 w8a8 with
unpadded steps where it has VNNI). Answering alone with the receipt's
recorded prefill chunk is what ``replay --regenerate`` does, so identical ids here
are what makes a batched answer's receipt replay.

Environment: ``RAGBUDGET_INVARIANCE_DEVICE`` (``cpu`` by default; ``cuda`` for the
prepared GPU check in scripts/gpu_check.sh), ``RAGBUDGET_INVARIANCE_THREADS``
(2 by default, the product's default), ``RAGBUDGET_INVARIANCE_MAX_NEW`` (6).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.prompting.prompt import DEFAULT_SCAFFOLD_TEXT, PromptBuilder, PromptChunk
from generation.base import GenParams
from generation.precision import bf16_supported, int8_supported
from tests.conftest import CORPORA

pytestmark = pytest.mark.slow

HTML = "usr/share/doc/postgresql-doc-15/html"
PAGES = ["app-pgdump.html", "backup-dump.html", "routine-vacuuming.html", "continuous-archiving.html"]
QUESTIONS = [
    "How do I dump a database with pg_dump in the custom archive format?",
    "Which pg_dump option dumps only the schema, not the data?",
    "How can pg_dump run several jobs in parallel?",
    "How do I restore a dump made in the directory format?",
    "What does pg_dumpall dump that pg_dump does not?",
    "How do I dump a single table?",
    "Can pg_dump dump a database while it is being used?",
    "How do I compress the output of pg_dump?",
    "Why must tables be vacuumed regularly?",
    "What is transaction ID wraparound?",
    "What does autovacuum do?",
    "When should VACUUM FULL be used?",
    "How does VACUUM update planner statistics?",
    "What is the visibility map used for?",
    "How do I set up continuous archiving of WAL files?",
    "What does archive_command do?",
    "How do I make a base backup with pg_basebackup?",
    "How do I recover to a point in time?",
    "What is a recovery target?",
    "What happens if the archive command fails?",
]
MIXES = [2, 3, 7, 8]  # 20 questions in groups of 2 to 8 concurrent arrivals


def _paragraphs(deb: Path, tmp: Path) -> list[str]:
    from retrieval.extract import html_to_text

    tar = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp), *[f"./{HTML}/{p}" for p in PAGES]], input=tar, check=True)
    out: list[str] = []
    for page in PAGES:
        text = html_to_text((tmp / HTML / page).read_bytes())
        out += [p.strip() for p in re.split(r"\n\s*\n", text) if 200 <= len(p.strip()) <= 700]
    return out


@pytest.fixture(scope="module", params=["fp32", pytest.param("bf16", marks=pytest.mark.skipif(
    not bf16_supported() or os.environ.get("RAGBUDGET_INVARIANCE_DEVICE", "cpu") != "cpu",
    reason="bf16 precision needs the CPU device and avx512_bf16 or amx_bf16 (/proc/cpuinfo flags)")),
    *[pytest.param(p, marks=pytest.mark.skipif(
        not int8_supported() or os.environ.get("RAGBUDGET_INVARIANCE_DEVICE", "cpu") != "cpu",
        reason="int8 precisions need the CPU device and avx512_vnni, avx_vnni or amx_int8"))
      for p in ("int8", "int8a16")]])
def gen(request: pytest.FixtureRequest, smollm_dir: Path, smollm_tokenizer: Any) -> Iterator[Any]:
    import torch

    from generation.local import LocalGenerator

    before = torch.get_num_threads()
    g = LocalGenerator(smollm_dir, tokenizer=smollm_tokenizer,
                       device=os.environ.get("RAGBUDGET_INVARIANCE_DEVICE", "cpu"),
                       threads=int(os.environ.get("RAGBUDGET_INVARIANCE_THREADS", "2")),
                       precision=request.param)
    yield g
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts(gen: Any, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    deb = CORPORA / "postgresql-doc-15_15.18-0+deb12u1_all.deb"
    if not deb.exists() or shutil.which("dpkg-deb") is None:
        pytest.skip("real corpus or dpkg-deb not available")
    paras = _paragraphs(deb, tmp_path_factory.mktemp("pgdoc"))
    assert len(paras) >= 10
    builder = PromptBuilder.for_generator(gen)
    out = []
    for i, q in enumerate(QUESTIONS):
        words = {w for w in re.findall(r"[a-z_]{4,}", q.lower())}
        ranked = sorted(range(len(paras)), key=lambda j: (-len(words & set(paras[j].lower().split())), j))
        chunks = [PromptChunk(j + 1, 1, paras[j]) for j in ranked[: 1 + i % 2]]
        out.append(builder.build(DEFAULT_SCAFFOLD_TEXT, chunks, q))
    return out


def _answer(gen: Any, prompt: Any, params: GenParams, chunk: int | None = None) -> list[int]:
    return [e.token_id for e in gen.stream(prompt.ids, cached_prefix_ids=prompt.scaffold_ids,
                                           params=params, prefill_chunk=chunk)]


def test_answers_are_identical_alone_and_in_concurrent_mixes(gen: Any, prompts: list[Any]) -> None:
    params = GenParams(max_new_tokens=int(os.environ.get("RAGBUDGET_INVARIANCE_MAX_NEW", "6")))
    recorded_chunk = gen.identity["engine"]["prefill_chunk"]
    gen.prefix_cache.clear()  # the first answer computes the scaffold; the rest reuse it
    alone = [_answer(gen, p, params, recorded_chunk) for p in prompts]
    assert all(alone)
    rnd = random.Random(19)
    order = list(range(len(prompts)))
    rnd.shuffle(order)
    batched: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    peak = 0
    start = 0
    for size in MIXES:
        group = order[start:start + size]
        start += size
        offsets = {i: rnd.uniform(0.0, 0.4) for i in group}

        def run(i: int, offsets: dict[int, float] = offsets) -> None:
            try:
                time.sleep(offsets[i])
                batched[i] = _answer(gen, prompts[i], params)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        gen.engine.peak_rows_answers = 0
        threads = [threading.Thread(target=run, args=(i,)) for i in group]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        peak = max(peak, gen.engine.peak_rows_answers)
    assert not errors
    assert start == len(prompts)
    differ = [i for i in range(len(prompts)) if batched[i] != alone[i]]
    assert differ == [], f"questions {differ} changed when batched"
    assert peak >= 2  # answers really shared engine steps


def test_a_cancelled_batch_mate_does_not_change_the_others(gen: Any, prompts: list[Any]) -> None:
    params = GenParams(max_new_tokens=6)
    want = _answer(gen, prompts[0], params)
    cancel = threading.Event()
    got: list[int] = []

    def victim() -> None:
        for n, _ in enumerate(gen.stream(prompts[1].ids, cached_prefix_ids=prompts[1].scaffold_ids,
                                         params=GenParams(max_new_tokens=40), cancel=cancel)):
            if n == 1:
                cancel.set()

    t = threading.Thread(target=victim)
    t.start()
    got = _answer(gen, prompts[0], params)
    t.join()
    assert got == want
