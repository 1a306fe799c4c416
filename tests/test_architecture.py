"""The import graph keeps the rooms' arrows of docs/architecture.md, with no circle between modules.

The first tests read the project itself; the rest pin the checker
(``tests/import_graph.py``) on small synthetic trees, so a rule that could
never fail would show here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import ROOMS, cycles, edges, violations

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
