"""The import graph keeps the rooms' arrows of docs/architecture.md, with no circle between modules.

The first tests read the project itself; the rest pin the checker
(``tests/import_graph.py``) on small synthetic trees, so a rule that could
never fail would show here.
"""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from tests.import_graph import ROOMS, cycles, edges, module_names, violations

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def project_edges() -> list:  # type: ignore[type-arg]
    return edges(REPO)


def test_project_graph_is_read_from_every_room_including_function_level_imports(project_edges) -> None:
    pairs = {(e.importer, e.imported) for e in project_edges}
    assert ("app.api.routes_documents", "app.ingest") in pairs
    # a lazy import inside a function body counts as an edge
    assert ("app.services", "retrieval.embedding") in pairs
    assert {e.importer.split(".")[0] for e in project_edges} >= set(ROOMS) - {"scripts", "migrations"}


def test_project_rooms_import_only_along_the_allowed_arrows(project_edges) -> None:
    assert violations(project_edges) == []


def test_project_has_no_import_circle_between_modules(project_edges) -> None:
    assert cycles(project_edges) == []


# --- the checker on synthetic trees --------------------------------------------------------------

def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
        for parent in f.relative_to(root).parents:
            init = root / parent / "__init__.py"
            if parent != Path(".") and not init.exists():
                init.write_text("")
    return root


def test_clean_synthetic_tree_has_no_violation_and_no_circle(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "foundation/errors.py": "",
        "retrieval/store.py": "from foundation import errors\n",
        "app/ingest.py": "from retrieval.store import x\n",
        "app/api/routes.py": "from app.ingest import y\n",
        "benchmarks/b.py": "from app.ingest import y\n",
    })
    found = edges(root)
    assert {(e.importer, e.imported) for e in found} == {
        ("retrieval.store", "foundation.errors"), ("app.ingest", "retrieval.store"),
        ("app.api.routes", "app.ingest"), ("benchmarks.b", "app.ingest")}
    assert violations(found) == [] and cycles(found) == []


def test_lower_room_importing_a_higher_room_is_a_violation(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"app/services.py": "", "retrieval/index.py": "import app.services\n"})
    (bad,) = violations(edges(root))
    assert "room retrieval may not import room app" in bad and "retrieval/index.py:1" in bad


def test_generation_may_import_only_the_tokens_module_of_retrieval(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"retrieval/tokens.py": "", "retrieval/store.py": "",
                            "generation/local.py": "from retrieval.tokens import T\n",
                            "generation/remote.py": "from retrieval import store\n"})
    (bad,) = violations(edges(root))
    assert "may import only retrieval.tokens" in bad and "generation.remote -> retrieval.store" in bad


@pytest.mark.parametrize(("importer", "text", "rule"), [
    ("app/api/routes.py", "from app.cli.common import emit\n", "app.api -> app.cli"),
    ("benchmarks/bench.py", "from tests.receipts import bodies\n", "benchmarks -> tests"),
    ("benchmarks/bench.py", "def f():\n    from app.cli import corpus_cmds\n", "benchmarks -> app.cli"),
])
def test_borrowed_edges_are_violations(tmp_path: Path, importer: str, text: str, rule: str) -> None:
    root = _tree(tmp_path, {importer: text, "app/cli/common.py": "", "app/cli/corpus_cmds.py": "",
                            "tests/receipts/bodies.py": ""})
    assert any(f"forbidden edge {rule}" in v for v in violations(edges(root)))


def test_circle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "app/cli/main.py": "from app.cli import demo\n",
        "app/cli/demo.py": "def run():\n    from app.cli.main import build_parser\n",
        "app/cli/other.py": "from app.cli import main\n",
    })
    assert cycles(edges(root)) == [["app.cli.demo", "app.cli.main"]]


def test_relative_imports_resolve_against_the_importing_package(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"receipts/chain.py": "from .verify import v\n",
                            "receipts/verify.py": "from . import chain\n"})
    found = edges(root)
    assert {(e.importer, e.imported) for e in found} == {("receipts.chain", "receipts.verify"),
                                                         ("receipts.verify", "receipts.chain")}
    assert cycles(found) == [["receipts.chain", "receipts.verify"]]


# --- the repository's house: benchmarks, docs and what ships ------------------------------------

#: Rooms installed by the wheel (pyproject.toml's package list) and where code lives.
PRODUCT_ROOMS = ("app", "retrieval", "generation", "latency_model", "receipts", "foundation", "migrations")
CODE_ROOMS = (*PRODUCT_ROOMS, "benchmarks", "scripts", "tests", "ragbudget_testing")
DOCS = (*sorted((REPO / "docs").glob("*.md")), REPO / "README.md")

#: A relative repository path in prose: ``benchmarks/results/x.jsonl``, ``docs/x.md``, ``scripts/x.sh``.
#: Not preceded by ``:`` (``git show REV:docs/x.jsonl`` names a file of another revision).
CITED_PATH = re.compile(r"(?<![\w/.:<-])((?:" + "|".join((*CODE_ROOMS, "docs"))
                        + r")/[\w./-]*\w\.(?:py|md|sh|jsonl|json|png|csv|toml|ini))(?![\w/])")
#: A bare Markdown file name (``NOTES.md``), found at the root, in docs/ or next to the citing file.
CITED_MD = re.compile(r"(?<![\w/.-])([A-Za-z_][\w-]*\.md)(?![\w/])")
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)")


def _heading_anchors(md: Path) -> set[str]:
    """GitHub's anchors of ``md``'s headings: lower case, punctuation dropped, spaces to ``-``."""
    seen: dict[str, int] = {}
    in_code = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.*)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def _code_files() -> list[Path]:
    return [p for room in CODE_ROOMS for p in sorted((REPO / room).rglob("*"))
            if p.suffix in {".py", ".sh", ".ini", ".toml", ".cfg"} and "__pycache__" not in p.parts]


def test_benchmarks_never_edit_the_import_path() -> None:
    # run as ``python -m benchmarks.NAME`` from the root, a benchmark needs no path of its own
    offenders = [str(p.relative_to(REPO)) for p in sorted((REPO / "benchmarks").rglob("*.py"))
                 if "sys.path" in p.read_text(encoding="utf-8")]
    assert offenders == []


def test_docs_hold_no_raw_run_files() -> None:
    # run files the docs cite live in benchmarks/results/; the rest stay in git history
    assert sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.jsonl")) == []


def test_code_cites_no_design_file_the_repository_lacks() -> None:
    name = "DESIGN" + ".md"
    assert not (REPO / name).exists()
    offenders = [str(p.relative_to(REPO)) for p in _code_files() if name in p.read_text(encoding="utf-8")]
    assert offenders == []


def test_every_path_the_docs_cite_exists() -> None:
    missing = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        missing += [(doc.name, m) for m in CITED_PATH.findall(text) if not (REPO / m).exists()]
        missing += [(doc.name, m) for m in CITED_MD.findall(text)
                    if not any((d / m).exists() for d in (REPO, REPO / "docs", doc.parent))]
        missing += [(doc.name, target) for target, _ in LINK.findall(text)
                    if target and "://" not in target and not (doc.parent / target).exists()]
    assert missing == []


def test_every_anchor_the_docs_link_to_is_a_heading() -> None:
    broken = [(doc.name, target, anchor) for doc in DOCS
              for target, anchor in LINK.findall(doc.read_text(encoding="utf-8"))
              if anchor and "://" not in target and (doc.parent / target if target else doc).is_file()
              and anchor not in _heading_anchors(doc.parent / target if target else doc)]
    assert broken == []


def test_shipped_modules_are_not_helpers_only_tests_and_benchmarks_import(project_edges) -> None:
    # a module of an installed room that only tests, benchmarks or scripts import is test support
    # shipped in the wheel; it belongs in ragbudget_testing/ (not installed)
    entry_points = {v.split(":")[0] for v in
                    tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"].values()}
    importers: dict[str, set[str]] = {}
    for e in project_edges:
        importers.setdefault(e.imported, set()).add(e.importer.split(".")[0])
    packages = {m for m, path in module_names(REPO).items() if path.name == "__init__.py"}
    helpers = sorted(m for m, rooms in importers.items()
                     if m.split(".")[0] in PRODUCT_ROOMS and m not in packages | entry_points
                     and not rooms & set(PRODUCT_ROOMS))
    assert helpers == []


def test_test_support_package_is_left_out_of_the_wheel() -> None:
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    shipped = {room for room in (*PRODUCT_ROOMS, "ragbudget_testing", "tests", "benchmarks")
               if any(fnmatch(room, pattern) for pattern in find["include"])}
    assert shipped == set(PRODUCT_ROOMS)


def test_the_doc_checks_catch_a_missing_path_and_a_missing_anchor(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("# Latest figure\n\nsee [y](y.md) and [here](#latest-figure), [gone](#old-run)\n")
    assert CITED_PATH.findall("raw rows `benchmarks/results/load-grid-16.jsonl`; "
                              "git show abc:docs/load.jsonl") == ["benchmarks/results/load-grid-16.jsonl"]
    assert [t for t, _ in LINK.findall(doc.read_text()) if t and not (tmp_path / t).exists()] == ["y.md"]
    assert "latest-figure" in _heading_anchors(doc) and "old-run" not in _heading_anchors(doc)


def test_every_run_file_in_benchmarks_results_is_cited_by_the_docs() -> None:
    # a run file no figure cites is history: git keeps it, the tree does not
    cited = "\n".join(doc.read_text(encoding="utf-8") for doc in DOCS)
    uncited = [p.name for p in sorted((REPO / "benchmarks" / "results").iterdir())
               if f"benchmarks/results/{p.name}" not in cited]
    assert uncited == []


# --- the answer path's rooms (app/answering/, app/prompting/) ----------------------------------

#: Each room of the answer path -> the rooms of ``app`` it may never import (docs/architecture.md,
#: "The answer path's rooms"). The prompt never reaches the answer path that lays it out; neither
#: reaches an interface (API, CLI, console), which import both.
APP_INTERFACES = ("app.api", "app.cli", "app.ui")
APP_ROOM_BANS: dict[str, tuple[str, ...]] = {
    "app.prompting": ("app.answering", *APP_INTERFACES),
    "app.answering": APP_INTERFACES,
}
#: The modules each room holds (one concept each).
APP_ROOMS: dict[str, frozenset[str]] = {
    "app.answering": frozenset({"admit", "arrivals", "bands", "finish", "followup", "generate", "genqueue",
                                "kv_lookup", "pipeline", "receipt", "receipt_wiring", "state", "types",
                                "window"}),
    "app.prompting": frozenset({"conversation", "framing", "layout", "prompt", "slots"}),
}
#: The answer path's modules as they were before it had rooms: no module is left there.
FLAT_APP_MODULES = ("pipeline", "plan_bands", "answer_receipt", "receipt_wiring", "answer_state",
                    "answer_types", "genqueue", "arrivals", "kv_lookup", "slots", "layout", "framing",
                    "conversation", "prompt")


def _within(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def _app_room_violations(found: list) -> list[str]:  # type: ignore[type-arg]
    """Edges from a room of the answer path into a room it may not import, one line each."""
    return [str(e) for e in found for room, banned in APP_ROOM_BANS.items()
            if _within(e.importer, room) and any(_within(e.imported, b) for b in banned)]


def test_the_answer_path_has_its_rooms_and_they_import_only_along_their_arrows(project_edges) -> None:
    modules = module_names(REPO)
    for room, held in APP_ROOMS.items():
        assert {m.rpartition(".")[2] for m in modules if m.startswith(room + ".")} == held, room
        assert ast_docstring(modules[room]), room  # each room says what it does
    assert [m for m in FLAT_APP_MODULES if f"app.{m}" in modules] == []
    assert _app_room_violations(project_edges) == []
    # the interfaces do use both rooms, and the answer path lays its prompts out through the prompt's
    pairs = {(e.importer.rsplit(".", 1)[0], e.imported.rsplit(".", 1)[0]) for e in project_edges}
    assert {("app.api", "app.answering"), ("app.api", "app.prompting"),
            ("app.answering", "app.prompting")} <= pairs


def test_the_answer_path_rooms_check_bites(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"app/answering/pipeline.py": "from app.prompting.prompt import P\n",
                            "app/prompting/prompt.py": "from app.answering import state\n",
                            "app/answering/state.py": "def f():\n    from app.api.errors import E\n",
                            "app/api/errors.py": "from app.answering.pipeline import A\n"})
    # answering -> prompting and api -> answering are allowed; the other two are not
    assert sorted(v.split(" (")[0] for v in _app_room_violations(edges(root))) == [
        "app.answering.state -> app.api.errors", "app.prompting.prompt -> app.answering.state"]


def ast_docstring(path: Path) -> str | None:
    """The module docstring of ``path`` (None without one)."""
    import ast

    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))


def _chunk_hit_shapes(path: Path) -> list[str]:
    """Classes in ``path`` that declare a retrieved chunk's fields themselves (a ``score`` and a
    ``chunk_hash`` among their annotated fields)."""
    import ast

    return [node.name for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ClassDef)
            and {"score", "chunk_hash"} <= {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                                            and isinstance(s.target, ast.Name)}]


def test_one_chunk_hit_shape_is_declared_and_the_api_receipts_and_console_derive_from_it(
        tmp_path: Path) -> None:
    from app.answering.types import ChunkHit, Citation
    from app.api.routes_retrieval import HitPublic
    from app.ui.receipt_view import CandidateView

    declared = [(str(p.relative_to(REPO)), name) for p in sorted((REPO / "app").rglob("*.py"))
                for name in _chunk_hit_shapes(p)]
    assert declared == [("app/answering/types.py", "ChunkHit")]
    assert all(issubclass(k, ChunkHit) for k in (Citation, HitPublic, CandidateView))
    bad = tmp_path / "bad.py"
    bad.write_text("class Hit:\n    rank: int\n    score: float\n    chunk_hash: str\n")
    assert _chunk_hit_shapes(bad) == ["Hit"]  # the check bites


#: Capabilities only some generators and engines have: asked with the protocols of
#: ``generation.base`` (``isinstance``), never probed by name.
CAPABILITY_NAMES = frozenset({"engine", "prefill_chunk", "max_running", "prefix_cache", "cached_tokens",
                              "batch_snapshot", "step_token_budget", "recent_steps", "context_window"})


def _capability_probes(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` of every ``getattr``/``hasattr`` in ``path`` naming a capability."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in CAPABILITY_NAMES):
            found.append((node.lineno, str(node.args[1].value)))
    return found


def test_generator_capabilities_are_asked_through_the_protocols_not_probed_by_name(tmp_path: Path) -> None:
    from generation import base
    from generation.engine.core import Engine

    # the answer path and what it stands on (the interfaces hand a generator to a service)
    probes = [(str(p.relative_to(REPO)), line, name) for p in sorted((REPO / "app").rglob("*.py"))
              if p.parent.name not in ("api", "cli", "ui") for line, name in _capability_probes(p)]
    assert probes == []
    # the local engine has what the engine capabilities ask of it
    for proto, name in ((base.SupportsPrefixLookup, "cached_tokens"),
                        (base.SupportsBatchSnapshot, "batch_snapshot"),
                        (base.SupportsRecentSteps, "recent_steps")):
        assert name in vars(proto) and callable(vars(Engine).get(name)), proto.__name__
    bad = tmp_path / "bad.py"
    bad.write_text('def f(gen):\n    return getattr(gen, "engine", None), hasattr(gen, "prefill_chunk")\n')
    assert _capability_probes(bad) == [(2, "engine"), (2, "prefill_chunk")]  # the check bites


# --- the engine's rooms (generation/engine/) -----------------------------------------------------

#: Each room of the engine -> the project modules it may import (docs/architecture.md, "The
#: engine's rooms"). The scheduler and the messages import nothing of the project; the runner
#: never the core; nothing in the engine imports the generators built on it.
ENGINE_ARROWS: dict[str, frozenset[str]] = {
    "generation.engine.messages": frozenset(),
    "generation.engine.scheduler": frozenset(),
    "generation.engine.block_cache": frozenset(),
    "generation.engine.kv_cache": frozenset({"foundation.hashing", "generation.engine.block_cache"}),
    "generation.engine.request": frozenset({"generation.engine.kv_cache", "generation.engine.messages",
                                            "generation.engine.scheduler"}),
    "generation.engine.runner": frozenset({"foundation.compute", "generation.engine.request",
                                           "generation.engine.scheduler", "generation.packed_attention"}),
    "generation.engine.core": frozenset({"foundation.compute", "generation.engine.kv_cache",
                                         "generation.engine.messages", "generation.engine.request",
                                         "generation.engine.runner", "generation.engine.scheduler",
                                         "generation.sampling"}),
}
#: What the pure rooms may import at all: the standard library's typing and data classes.
PURE_IMPORTS = frozenset({"__future__", "collections", "dataclasses", "typing"})


def _imported_top_modules(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports, wherever the import stands."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_the_engine_has_its_rooms_and_they_import_only_along_their_arrows(project_edges) -> None:
    rooms = {m for m in module_names(REPO) if m.startswith("generation.engine.")}
    assert rooms == set(ENGINE_ARROWS)
    bad = [str(e) for e in project_edges
           if e.importer in ENGINE_ARROWS and e.imported not in ENGINE_ARROWS[e.importer]]
    assert bad == []
    # the runner runs plans; it never reaches back into the core that drives it
    assert not any(e.importer == "generation.engine.runner" and e.imported == "generation.engine.core"
                   for e in project_edges)


def test_the_scheduler_and_the_messages_are_pure() -> None:
    # no torch, no I/O: the latency model replays the scheduler without loading a model
    for name in ("scheduler", "messages"):
        path = REPO / "generation" / "engine" / f"{name}.py"
        assert _imported_top_modules(path) <= PURE_IMPORTS, name
    assert "torch" in _imported_top_modules(REPO / "generation" / "engine" / "runner.py")  # the check bites


def test_the_latency_model_prices_the_schedulers_own_plans(project_edges) -> None:
    # one definition of step shapes and row padding: the step model calls the scheduler
    reached = {e.imported for e in project_edges if e.importer == "latency_model.step_model"}
    assert {"generation.engine.scheduler", "generation.engine.messages"} <= reached
    text = (REPO / "latency_model" / "step_model.py").read_text(encoding="utf-8")
    assert "padded_rows(" in text and "schedule(" in text


def test_the_engines_messages_are_frozen_dataclasses() -> None:
    import dataclasses
    import typing

    from generation.engine import messages, scheduler

    kinds = [*typing.get_args(messages.EngineEvent), messages.BatchSnapshot, messages.Decoding,
             messages.Prefilling, messages.StepRecord, scheduler.StepPlan, scheduler.ScheduledChunk]
    assert {k.__name__ for k in typing.get_args(messages.EngineEvent)} == {"Admitted", "Token", "Finished"}
    for kind in kinds:
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen, kind.__name__  # type: ignore[attr-defined]


def _queue_puts(path: Path) -> list[tuple[int, str]]:
    """``(line, what)`` of every ``<answer>.out.put(...)`` in ``path``: the name of the class
    called to build the event, or the kind of expression put (``Tuple``, ``Name``, ...)."""
    import ast

    puts = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "put"
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "out"):
            arg = node.args[0] if node.args else None
            what = (arg.func.id if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Name)
                    else type(arg).__name__)
            puts.append((node.lineno, what))
    return puts


def test_the_engine_puts_only_typed_events_on_an_answers_queue(tmp_path: Path) -> None:
    events = {"Admitted", "Token", "Finished"}
    puts = [(p.name, line, what) for p in sorted((REPO / "generation").rglob("*.py"))
            for line, what in _queue_puts(p)]
    assert {what for _, _, what in puts} == events  # admit, emit and finish each put one kind
    assert [p for p in puts if p[2] not in events] == []
    bad = tmp_path / "bad.py"
    bad.write_text('def f(seq):\n    seq.out.put(("token", 1, 0.0))\n')
    assert _queue_puts(bad) == [(2, "Tuple")]  # the check bites


def _context_vars(path: Path) -> list[tuple[int, str]]:
    """``(line, what)`` of every use of :mod:`contextvars` in ``path``: its import, or a
    ``ContextVar`` name or attribute (a side channel beside a call's own arguments)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "contextvars" for a in node.names):
            found.append((node.lineno, "import contextvars"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "contextvars":
            found.append((node.lineno, "from contextvars"))
        elif (node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)) == "ContextVar":
            found.append((node.lineno, "ContextVar"))  # type: ignore[attr-defined]
    return found


def test_no_context_variable_carries_an_answer_between_the_pipeline_and_its_generator(tmp_path: Path) -> None:
    # one owner of the waiting line: an answer's options go to stream() as arguments and its
    # stats come back on the stream it returns, never through a ContextVar beside the call
    uses = [(str(p.relative_to(REPO)), line, what) for room in ("generation", "app")
            for p in sorted((REPO / room).rglob("*.py")) for line, what in _context_vars(p)]
    assert uses == []
    bad = tmp_path / "bad.py"
    bad.write_text("import contextvars\nfrom contextvars import ContextVar\n"
                   "X = contextvars.ContextVar('x')\n")
    assert sorted(_context_vars(bad)) == [(1, "import contextvars"), (2, "from contextvars"),
                                          (3, "ContextVar")]  # the check bites
