"""Every public definition in the project's rooms says what it is.

Walks ``app/``, ``generation/``, ``latency_model/``, ``receipts/``, ``retrieval/`` and
``foundation/`` with :mod:`ast` and fails on a public (non-underscore) module-level function
or class, or a public method of a public class, that has no docstring. Nested closures,
dunder methods, ``@overload`` stubs and property setters/deleters are exempt. The failure
names each offender as ``path:line name``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("app", "generation", "latency_model", "receipts", "retrieval", "foundation")
Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _exempt(node: Def) -> bool:
    """``@overload`` stubs and ``@x.setter`` / ``@x.deleter`` share the documented definition's name."""
    for dec in node.decorator_list:
        if isinstance(dec, ast.Attribute) and dec.attr in ("setter", "deleter", "overload"):
            return True
        if isinstance(dec, ast.Name) and dec.id == "overload":
            return True
    return False


def _public(node: ast.stmt) -> bool:
    return (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and not node.name.startswith("_") and not _exempt(node))


def undocumented(source: str, path: str) -> list[str]:
    """``path:line name`` (``Class.method`` for methods) of each public definition without a docstring."""
    out = []
    for node in ast.parse(source, filename=path).body:
        if not _public(node):
            continue
        assert isinstance(node, Def)
        if ast.get_docstring(node) is None:
            out.append(f"{path}:{node.lineno} {node.name}")
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if _public(member) and not isinstance(member, ast.ClassDef):
                    assert isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef)
                    if ast.get_docstring(member) is None:
                        out.append(f"{path}:{member.lineno} {node.name}.{member.name}")
    return out


def test_every_public_definition_has_a_docstring() -> None:
    offenders: list[str] = []
    files = 0
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            files += 1
            offenders += undocumented(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert files > 50  # the walk found the rooms
    assert not offenders, (f"{len(offenders)} public definition(s) without a docstring:\n  "
                           + "\n  ".join(offenders))


def test_the_check_finds_what_it_should() -> None:
    source = '''
def documented():
    """Yes."""

def bare():
    pass

def _private():
    pass

class Model:
    x: int

    def method(self):
        def closure():
            pass

    def _helper(self):
        pass

    def __init__(self):
        pass

    @property
    def value(self):
        """The value."""

    @value.setter
    def value(self, v):
        pass

class _Hidden:
    def method(self):
        pass

async def fetch():
    return 1
'''
    assert undocumented(source, "m.py") == ["m.py:5 bare", "m.py:11 Model", "m.py:14 Model.method",
                                            "m.py:36 fetch"]
