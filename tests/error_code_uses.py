"""Every place the project's rooms name a public error code, found with :mod:`ast`.

:func:`code_uses` walks ``app/``, ``foundation/``, ``generation/``, ``retrieval/``,
``receipts/`` and ``latency_model/`` and returns one :class:`CodeUse` per string literal
that is used as an error code, in any of these forms:

* ``code = "..."`` in a class body (an error class's own code);
* ``code="..."`` as a keyword argument of any call (``InvalidInput(..., code="invalid_k")``,
  ``ItemResult(..., code="unreadable")``, ``AnswerError(code=...)``);
* ``{"code": "..."}`` in a dict display (error bodies written by hand: streams, receipts);
* the code argument of ``error_body(code, ...)``, ``openai_error(status, code, ...)`` and
  ``respond(req, status, code, ...)`` (``app.api.errors``);
* the values of a dict assigned to a ``*_CODES`` name (``_HTTP_CODES``: status -> code) and
  the default of ``X_CODES.get(key, "...")``;
* the keys of a dict whose values are error classes (``{"too_large": TooLarge, ...}``);
* the code of a ``(path, code, reason)`` tuple appended to ``refused`` (``app.ingest``).

In each form the value may be a literal, a module-level string constant of the same
module (``BAD_HTTP_REQUEST = "bad_http_request"``), ``getattr(exc, "code", "...")`` (the
default is the code), ``ErrorCode.NAME`` (the member's code: its name in lower case),
``str(...)`` of one of these, or ``a or b`` / ``a if c else b`` (each literal branch is a
use). ``ErrorCode.NAME`` anywhere else counts as a use of that member too. An error class
defined outside ``foundation.errors`` (``class SamplingFailed(BackendError)``) counts as
its nearest ``foundation.errors`` ancestor.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("app", "foundation", "generation", "retrieval", "receipts", "latency_model")

#: Calls whose positional argument at this index is an error code (``app.api.errors``).
CODE_ARGUMENT = {"error_body": 0, "openai_error": 1, "respond": 2, "Passed": 3}
#: ... and whose positional argument at this index is the HTTP status sent with it.
STATUS_ARGUMENT = {"openai_error": 0, "respond": 1}


@dataclass(frozen=True)
class CodeUse:
    """One error code named at ``path:line`` (``path`` relative to the repository root).

    ``form`` says how (for the failure message); ``raised_as`` names the error class the
    code is given to when the site defines or calls an error class (or a dict maps the code
    to one), as its nearest ``foundation.errors`` class (:func:`error_classes`: the one
    whose status ``app.api.errors`` answers), else None; ``status`` is the HTTP status written beside
    the code at the site (``respond(req, 422, "invalid_request")``, ``_HTTP_CODES``), else None.
    """

    code: str
    path: str
    line: int
    form: str
    raised_as: str | None = None
    status: int | None = None

    def where(self) -> str:
        """``path:line`` as editors and pytest print it."""
        return f"{self.path}:{self.line}"


def _name(node: ast.expr) -> str | None:
    """``f`` for ``f(...)`` and ``x.f(...)``; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _int(node: ast.expr | None) -> int | None:
    return node.value if isinstance(node, ast.Constant) and type(node.value) is int else None


class _Walker(ast.NodeVisitor):
    """Collects the uses of one module (see the module docstring for the forms)."""

    def __init__(self, path: str, tree: ast.Module, error_classes: dict[str, str]) -> None:
        self.path = path
        self.error_classes = error_classes  # class name -> its nearest foundation.errors class
        self.uses: list[CodeUse] = []
        self.members: list[tuple[str, str, int]] = []  # (ErrorCode member name, path, line)
        self.constants: dict[str, str] = {}
        for stmt in tree.body:
            if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0], ast.Name) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)):
                self.constants[stmt.targets[0].id] = stmt.value.value

    def literals(self, node: ast.expr | None) -> Iterator[str]:
        """The code strings ``node`` can evaluate to (see the module docstring)."""
        if node is None:
            return
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, ast.Name) and node.id in self.constants:
            yield self.constants[node.id]
        elif isinstance(node, ast.Attribute) and _name(node.value) == "ErrorCode":
            yield node.attr.lower()  # a member's name is its code in capitals
        elif isinstance(node, ast.Call) and _name(node.func) == "getattr" and len(node.args) == 3:
            yield from self.literals(node.args[2])
        elif isinstance(node, ast.Call) and _name(node.func) == "str" and len(node.args) == 1:
            yield from self.literals(node.args[0])
        elif isinstance(node, ast.BoolOp):
            for value in node.values:
                yield from self.literals(value)
        elif isinstance(node, ast.IfExp):
            yield from self.literals(node.body)
            yield from self.literals(node.orelse)

    def add(self, node: ast.expr | None, line: int, form: str, raised_as: str | None = None,
            status: int | None = None) -> None:
        for code in self.literals(node):
            self.uses.append(CodeUse(code, self.path, line, form, raised_as, status))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for stmt in node.body:
            target = (stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                      else stmt.target if isinstance(stmt, ast.AnnAssign) else None)
            if isinstance(target, ast.Name) and target.id == "code":
                assert isinstance(stmt, ast.Assign | ast.AnnAssign)
                self.add(stmt.value, stmt.lineno, f"class {node.name}: code = ...",
                         self.error_classes.get(node.name))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = _name(node.func)
        raised_as = self.error_classes.get(func or "")
        for kw in node.keywords:
            if kw.arg == "code":
                self.add(kw.value, kw.value.lineno, f"{func or 'call'}(..., code=...)", raised_as)
        if func in CODE_ARGUMENT and len(node.args) > CODE_ARGUMENT[func]:
            at = STATUS_ARGUMENT.get(func)
            status = _int(node.args[at]) if at is not None and len(node.args) > at else None
            self.add(node.args[CODE_ARGUMENT[func]], node.lineno, f"{func}(...) code argument",
                     status=status)
        if (func == "get" and isinstance(node.func, ast.Attribute) and len(node.args) == 2
                and (_name(node.func.value) or "").endswith("_CODES")):
            self.add(node.args[1], node.lineno, f"{_name(node.func.value)}.get(..., default)")
        if (func == "append" and isinstance(node.func, ast.Attribute)
                and _name(node.func.value) == "refused" and len(node.args) == 1
                and isinstance(node.args[0], ast.Tuple) and len(node.args[0].elts) == 3):
            self.add(node.args[0].elts[1], node.lineno, "refused.append((path, code, reason))")
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == "code":
                self.add(value, value.lineno, '{"code": ...}')
            elif (isinstance(key, ast.Constant) and isinstance(key.value, str)
                  and isinstance(value, ast.Name) and value.id in self.error_classes):
                self.add(key, key.lineno, f"{{code: {value.id}}} (a code mapped to its class)",
                         raised_as=self.error_classes[value.id])
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        names = [_name(t) or "" for t in node.targets]
        if any(n.endswith("_CODES") for n in names) and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                self.add(value, value.lineno, f"{names[0]} value", status=_int(key))
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if (isinstance(node.target, ast.Name) and node.target.id.endswith("_CODES")
                and isinstance(node.value, ast.Dict)):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                self.add(value, value.lineno, f"{node.target.id} value", status=_int(key))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id == "ErrorCode":
            self.members.append((node.attr, self.path, node.lineno))
        self.generic_visit(node)


def error_classes(trees: list[ast.Module]) -> dict[str, str]:
    """Every error class by name -> its nearest :mod:`foundation.errors` class (the one whose
    status ``app.api.errors`` answers): that module's classes map to themselves; a class of
    ``trees`` deriving from one (``class SamplingFailed(BackendError)``) maps to its ancestor."""
    import foundation.errors as errors

    found = {name: name for name, obj in vars(errors).items()
             if isinstance(obj, type) and issubclass(obj, errors.RagBudgetError)}
    bases = {node.name: [b for b in map(_name, node.bases) if b] for tree in trees
             for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name not in found}
    grew = True
    while grew:
        grew = False
        for name, names in bases.items():
            ancestor = next((found[b] for b in names if b in found), None)
            if name not in found and ancestor is not None:
                found[name] = ancestor
                grew = True
    return found


def module_uses(source: str, path: str) -> tuple[list[CodeUse], list[tuple[str, str, int]]]:
    """The code uses in one module's ``source``, and its ``ErrorCode.NAME`` references."""
    tree = ast.parse(source, filename=path)
    walker = _Walker(path, tree, error_classes([tree]))
    walker.visit(tree)
    return walker.uses, walker.members


def code_uses(root: Path = ROOT) -> tuple[list[CodeUse], list[tuple[str, str, int]]]:
    """Every code use in the rooms (sorted by path and line), and every ``ErrorCode.NAME``
    reference as ``(member name, path, line)``."""
    paths = [path for room in ROOMS for path in sorted((root / room).rglob("*.py"))]
    trees = [ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for path in paths]
    classes = error_classes(trees)
    uses: list[CodeUse] = []
    members: list[tuple[str, str, int]] = []
    for path, tree in zip(paths, trees, strict=True):
        walker = _Walker(str(path.relative_to(root)), tree, classes)
        walker.visit(tree)
        uses += walker.uses
        members += walker.members
    return sorted(uses, key=lambda u: (u.path, u.line, u.code)), members
