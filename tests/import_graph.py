"""The project's import graph, read from source (``ast``), and the rules it must keep.

Every ``import``/``from ... import`` statement counts, wherever it stands: at
module level, inside a function (lazy imports), or under ``if TYPE_CHECKING``.
A ``from pkg import name`` where ``pkg.name`` is a module is an edge to that
module; otherwise an edge to ``pkg``. Relative imports are resolved against the
importing module's package. Only modules of the project (files under the given
root in the listed top-level folders) are nodes.

:func:`violations` applies the rules of docs/architecture.md: the allowed arrows
between rooms (:data:`ALLOWED`, with :data:`NARROW` edges that may reach only
named modules of a room), and the forbidden edges between sub-packages
(:data:`FORBIDDEN_PREFIXES`). :func:`cycles` finds circles between modules
(strongly connected components of two or more modules, or a module importing
itself).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

#: Top-level folders that are rooms (packages) of the project, plus the script folders.
ROOMS = ("foundation", "retrieval", "latency_model", "generation", "receipts", "app", "migrations",
         "tests", "benchmarks", "scripts", "ragbudget_testing")

#: room -> the rooms it may import (itself always allowed). ``tests`` may import everything.
ALLOWED: dict[str, frozenset[str]] = {
    "foundation": frozenset(),
    "latency_model": frozenset({"foundation", "generation"}),
    "retrieval": frozenset({"foundation"}),
    "generation": frozenset({"foundation", "retrieval"}),
    "receipts": frozenset({"foundation", "retrieval"}),
    "app": frozenset({"foundation", "retrieval", "latency_model", "generation", "receipts"}),
    "migrations": frozenset({"foundation", "retrieval", "receipts", "app"}),
    "benchmarks": frozenset({"foundation", "retrieval", "latency_model", "generation", "receipts", "app",
                             "ragbudget_testing"}),
    "scripts": frozenset({"foundation", "retrieval", "latency_model", "generation", "receipts", "app"}),
    "tests": frozenset(ROOMS),
    # test and benchmark support, not in the wheel: no product room may import it
    "ragbudget_testing": frozenset({"foundation", "retrieval", "receipts"}),
}

#: (room, target room) -> the only modules (or packages, by prefix) of the target it may import.
NARROW: dict[tuple[str, str], tuple[str, ...]] = {
    ("generation", "retrieval"): ("retrieval.tokens",),
    # the engine's pure scheduler and its message types (no torch): the latency model prices
    # the scheduler's own plans
    ("latency_model", "generation"): ("generation.engine.scheduler", "generation.engine.messages"),
    ("migrations", "retrieval"): ("retrieval.models",),
    ("migrations", "receipts"): ("receipts.models",),
    ("migrations", "app"): ("app.models",),
}

#: (importer prefix, imported prefix): edges that are never allowed, whatever the rooms.
FORBIDDEN_PREFIXES: tuple[tuple[str, str], ...] = (
    ("app.api", "app.cli"),
    ("benchmarks", "tests"),
    ("benchmarks", "app.cli"),
    ("scripts", "tests"),
)


@dataclass(frozen=True)
class Edge:
    """``importer`` imports ``imported`` at ``path``:``line``."""

    importer: str
    imported: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} ({self.path}:{self.line})"


def module_names(root: Path, rooms: Iterable[str] = ROOMS) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under ``root/<room>`` (``__init__`` -> package)."""
    out: dict[str, Path] = {}
    for room in rooms:
        base = root / room
        if not base.is_dir():
            continue
        for f in sorted(base.rglob("*.py")):
            rel = f.relative_to(root).with_suffix("")
            if any(part.startswith(".") for part in rel.parts):
                continue
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _resolve(modules: Mapping[str, Path], name: str) -> str | None:
    """The longest project module that ``name`` is or lies in (``a.b.c`` -> ``a.b`` if no ``a.b.c``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def edges(root: Path, rooms: Iterable[str] = ROOMS) -> list[Edge]:
    """Every import edge between project modules under ``root``, self-imports excluded."""
    modules = module_names(root, rooms)
    out: list[Edge] = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel_path = str(path.relative_to(root))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = _package_of(mod, path).split(".")
                    pkg = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                    base = ".".join(pkg + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            for t in targets:
                resolved = _resolve(modules, t)
                if resolved is not None and resolved != mod:
                    out.append(Edge(mod, resolved, rel_path, node.lineno))
    return list(dict.fromkeys(out))


def _room(module: str) -> str:
    return module.split(".", 1)[0]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(all_edges: Iterable[Edge]) -> list[str]:
    """Edges that break the room rules, one line each (empty when the graph is clean)."""
    bad: list[str] = []
    for e in all_edges:
        src, dst = _room(e.importer), _room(e.imported)
        for a, b in FORBIDDEN_PREFIXES:
            if _within(e.importer, a) and _within(e.imported, b):
                bad.append(f"forbidden edge {a} -> {b}: {e}")
        if src == dst:
            continue
        if dst not in ALLOWED.get(src, frozenset()):
            bad.append(f"room {src} may not import room {dst}: {e}")
            continue
        narrow = NARROW.get((src, dst))
        if narrow is not None and not any(_within(e.imported, m) for m in narrow):
            bad.append(f"room {src} may import only {', '.join(narrow)} of {dst}: {e}")
    return bad


def cycles(all_edges: Iterable[Edge]) -> list[list[str]]:
    """Circles between modules: each strongly connected component of two or more modules, sorted.

    Tarjan's algorithm, iterative (the graph has a few hundred nodes).
    """
    graph: dict[str, set[str]] = {}
    for e in all_edges:
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)
