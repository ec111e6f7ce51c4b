"""sglang's own functions, without importing the module that defines them.

Some of sglang's modules cost seconds of CPU to import (``managers/scheduler.py``
builds the whole model stack; ``ray/engine.py`` imports it through the entry points)
while the Ray tests need two small functions of each. ``functions_from_source``
compiles just those functions from the installed module's source file, keeping its
file name and line numbers (tracebacks point into sglang's file), after that file's
own top-level import statements of every global name they use: their code and the
objects they call are sglang's, unchanged.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import types

_ANNOTATIONS = "annotations"


def functions_from_source(module_name: str, names: tuple[str, ...]) -> types.ModuleType:
    """A module named ``module_name`` holding only its functions ``names``."""
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin:
        raise ImportError(f"{module_name} is not installed in this interpreter")
    with open(spec.origin) as source:
        tree = ast.parse(source.read(), filename=spec.origin)
    functions = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in names
    ]
    missing = set(names) - {f.name for f in functions}
    if missing:
        raise ImportError(f"{spec.origin} defines no {sorted(missing)}")
    future = [
        node
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module == "__future__"
    ]
    postponed = any(a.name == _ANNOTATIONS for node in future for a in node.names)
    imports = _imports_for(tree, functions, spec.origin, postponed=postponed)
    module = types.ModuleType(module_name)
    module.__file__ = spec.origin
    code = compile(
        ast.Module(body=[*future, *imports, *functions], type_ignores=[]),
        spec.origin,
        "exec",
        dont_inherit=True,
    )
    exec(code, module.__dict__)
    return module


class _Names(ast.NodeVisitor):
    """The names a function reads and binds; with postponed annotations (PEP 563)
    the names in its annotations are never evaluated, so they are not read."""

    def __init__(self, *, postponed: bool) -> None:
        self.postponed = postponed
        self.read: set[str] = set()
        self.bound: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        (self.read if isinstance(node.ctx, ast.Load) else self.bound).add(node.id)

    def visit_arg(self, node: ast.arg) -> None:
        self.bound.add(node.arg)
        if node.annotation is not None and not self.postponed:
            self.visit(node.annotation)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.bound.add(node.name)
        for field in ("decorator_list", "body"):
            for child in getattr(node, field):
                self.visit(child)
        self.visit(node.args)
        if node.returns is not None and not self.postponed:
            self.visit(node.returns)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.visit(node.target)
        if node.value is not None:
            self.visit(node.value)
        if not self.postponed:
            self.visit(node.annotation)


def _imports_for(
    tree: ast.Module, functions: list, origin: str, *, postponed: bool
) -> list[ast.stmt]:
    """The module's top-level import statements, narrowed to the global names that
    ``functions`` read."""
    names = _Names(postponed=postponed)
    for function in functions:
        names.visit(function)
    wanted = names.read - names.bound - set(dir(builtins))
    imports: list[ast.stmt] = []
    for node in tree.body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or getattr(
            node, "level", 0
        ):
            continue
        aliases = [
            a for a in node.names if (a.asname or a.name.partition(".")[0]) in wanted
        ]
        if not aliases or getattr(node, "module", None) == "__future__":
            continue
        wanted -= {a.asname or a.name.partition(".")[0] for a in aliases}
        narrowed = (
            ast.Import(names=aliases)
            if isinstance(node, ast.Import)
            else ast.ImportFrom(module=node.module, names=aliases, level=0)
        )
        imports.append(ast.copy_location(narrowed, node))
    if wanted:
        raise ImportError(
            f"{origin}: {sorted(wanted)} are not bound by a top-level import there; "
            "functions_from_source cannot provide them"
        )
    return imports
