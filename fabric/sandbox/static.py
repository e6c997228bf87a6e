"""First layer: a static check of a pushdown snippet when its binding compiles.

``check_snippet`` parses the snippet and reports, at the binding file's line and column,
syntax errors, a missing ``def run(table, ...)``, imports outside the allowlist and
statically obvious hostile constructs (dunder names, frame/code attributes, eval/exec,
format strings that walk attributes).  It is only the first layer: the worker's runtime
layer and the operating-system layers hold even when this check is bypassed.
"""

from __future__ import annotations

import ast
import string

from dsl.errors import Diagnostic, Span, did_you_mean

from .errors import printable
from .policy import (
    ALLOWED_DUNDER_METHODS,
    DUNDER_IN_TEXT,
    FORBIDDEN_BUILTINS,
    attribute_forbidden,
    importable,
    resolve_modules,
)


def check_snippet(
    source: str, *, file: str, line: int, col: int, allowed_modules: frozenset[str] | None = None
) -> list[Diagnostic]:
    """Diagnostics for a snippet whose first character sits at ``file:line:col``.

    Every snippet line is taken to be indented by ``col - 1`` columns in the file (a YAML
    block scalar), so a problem on snippet line ``n`` is reported at file line
    ``line + n - 1``.  An empty list means the snippet passed the static layer.
    ``allowed_modules`` replaces the default allowlist (see ``policy.resolve_modules``).
    """
    allowed = resolve_modules(allowed_modules)
    where = _Where(source, file, line, col)
    try:
        tree = ast.parse(source, filename=file, mode="exec")
    except SyntaxError as exc:
        return [
            where.diag(
                f"syntax error in pushdown python: {exc.msg}",
                exc.lineno or 1,
                exc.offset or 1,
                hint="fix the Python syntax of the snippet",
            )
        ]
    checker = _Checker(where, _bound_names(tree), allowed)
    checker.visit(tree)
    diags = checker.diags
    runs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run"]
    if not runs:
        async_run = [
            n for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "run"
        ]
        at = async_run[0] if async_run else None
        diags.append(
            where.diag(
                "pushdown python must define a top-level function 'run'"
                + (" (not 'async def')" if at else ""),
                at.lineno if at else 1,
                at.col_offset + 1 if at else 1,
                hint="define `def run(table):` taking a pyarrow.Table and returning one",
            )
        )
    else:
        args = runs[-1].args
        if not (args.posonlyargs or args.args) and not args.vararg:
            fn = runs[-1]
            diags.append(
                where.diag(
                    "'run' must take the table as its first parameter",
                    fn.lineno,
                    fn.col_offset + 1,
                    hint="write `def run(table, ...)`",
                )
            )
    return diags


def snippet_params(source: str) -> tuple[str, ...]:
    """Names of ``run``'s parameters after the table (filled from ``params`` by keyword)."""
    tree = ast.parse(source)
    for node in reversed(tree.body):  # the last definition is the one that runs
        if isinstance(node, ast.FunctionDef) and node.name == "run":
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args][1:] + [x.arg for x in a.kwonlyargs]
            return tuple(names)
    return ()


class _Where:
    def __init__(self, source: str, file: str, line: int, col: int):
        self.lines = source.splitlines()
        self.file, self.line, self.col = file, line, col

    def diag(
        self,
        message: str,
        lineno: int,
        col: int,
        end_col: int | None = None,
        hint: str | None = None,
    ) -> Diagnostic:
        text = self.lines[lineno - 1] if 0 < lineno <= len(self.lines) else ""
        shift = self.col - 1
        span = Span(
            self.file,
            self.line + lineno - 1,
            col + shift,
            None,
            None if end_col is None else end_col + shift,
        )
        return Diagnostic(message, span, hint, source_line=" " * shift + printable(text))


class _Checker(ast.NodeVisitor):
    def __init__(self, where: _Where, bound: set[str], allowed: frozenset[str]):
        self.where, self.bound = where, bound
        self.allowed, self.importable = allowed, importable(allowed)
        self.diags: list[Diagnostic] = []
        self.class_depth = 0

    def flag(self, node: ast.AST, message: str, hint: str | None = None) -> None:
        lineno = getattr(node, "lineno", 1)
        col = getattr(node, "col_offset", 0) + 1
        end = getattr(node, "end_col_offset", None)
        same_line = getattr(node, "end_lineno", lineno) == lineno
        self.diags.append(
            self.where.diag(
                message, lineno, col, end + 1 if end is not None and same_line else None, hint
            )
        )

    # imports ---------------------------------------------------------------------------
    def _check_module(self, node: ast.AST, name: str) -> None:
        if name not in self.importable:
            self.flag(
                node,
                f"import of '{name}' is not allowed in pushdown python",
                did_you_mean(name, sorted(self.allowed), "allowed modules"),
            )

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._check_module(node, alias.name)
            self._check_bound_name(node, alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            self.flag(
                node,
                "relative imports are not allowed in pushdown python",
                "import one of the allowed modules by its full name",
            )
            return
        module = node.module or ""
        self._check_module(node, module)
        for alias in node.names:
            if alias.name == "*":
                self.flag(
                    node,
                    "'from ... import *' is not allowed in pushdown python",
                    f"import the names you use: from {module} import a, b",
                )
            elif alias.name.startswith("_") or alias.name in _hidden(module):
                self.flag(node, f"'{module}.{alias.name}' is not available in pushdown python")
            self._check_bound_name(node, alias.asname or alias.name)

    def _check_bound_name(self, node: ast.AST, name: str) -> None:
        if name.startswith("__"):
            self.flag(node, f"the name '{name}' is not allowed in pushdown python")

    # names and attributes --------------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        if DUNDER_IN_TEXT.fullmatch(node.id) or (
            node.id in FORBIDDEN_BUILTINS and node.id not in self.bound
        ):
            self.flag(
                node,
                f"'{node.id}' is not allowed in pushdown python",
                "pushdown code may only transform the table it is given",
            )
        elif node.id.startswith("__"):
            self.flag(node, f"the name '{node.id}' is not allowed in pushdown python")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if attribute_forbidden(node.attr):
            self.flag(
                node,
                f"access to attribute '{node.attr}' is not allowed in pushdown python",
                "private, dunder, frame and code attributes reach interpreter internals",
            )
        elif node.attr == "format" and not _literal_format_ok(node.value):
            self.flag(
                node,
                "'.format' is only allowed on a string literal without attribute or index fields",
                "use an f-string",
            )
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id == "type" and len(node.args) + len(node.keywords) > 1:
            self.flag(
                node,
                "type() with a name, bases and namespace is not allowed in pushdown python",
                "write a class statement (a namespace built at run time can hold special names)",
            )
        if isinstance(fn, ast.Name) and fn.id in ("getattr", "hasattr") and len(node.args) >= 2:
            name = node.args[1]
            if (
                isinstance(name, ast.Constant)
                and isinstance(name.value, str)
                and attribute_forbidden(name.value)
            ):
                self.flag(
                    node,
                    f"{fn.id}() on '{name.value}' is not allowed in pushdown python",
                    "private, dunder, frame and code attributes reach interpreter internals",
                )
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str | bytes):
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            if DUNDER_IN_TEXT.search(text):
                self.flag(
                    node,
                    "a dunder name inside a string is not allowed in pushdown python",
                    "strings like '__class__' are used to reach interpreter internals",
                )

    # definitions -----------------------------------------------------------------------
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._check_bound_name(node, node.name)
        if node.keywords:
            self.flag(node, "class keywords (metaclass=...) are not allowed in pushdown python")
        self.class_depth += 1
        for stmt in node.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                if stmt.name.startswith("__") and stmt.name not in ALLOWED_DUNDER_METHODS:
                    self.flag(
                        stmt,
                        f"defining '{stmt.name}' is not allowed in pushdown python",
                        f"allowed special methods: {', '.join(sorted(ALLOWED_DUNDER_METHODS))}",
                    )
                self._visit_function_parts(stmt)
            else:
                self.visit(stmt)
        self.class_depth -= 1

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._check_bound_name(node, node.name)
        self._visit_function_parts(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def _visit_function_parts(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for arg in [
            *node.args.posonlyargs,
            *node.args.args,
            *node.args.kwonlyargs,
            node.args.vararg,
            node.args.kwarg,
        ]:
            if arg is not None:
                self._check_bound_name(arg, arg.arg)
        for part in [
            *node.decorator_list,
            *node.args.defaults,
            *[d for d in node.args.kw_defaults if d is not None],
            *node.body,
        ]:
            self.visit(part)
        if node.returns:
            self.visit(node.returns)

    def visit_Global(self, node: ast.Global) -> None:
        for name in node.names:
            self._check_bound_name(node, name)

    visit_Nonlocal = visit_Global  # type: ignore[assignment]


def _bound_names(tree: ast.AST) -> set[str]:
    """Names the snippet binds itself (a local ``input`` is not the builtin)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound


def _hidden(module: str) -> frozenset[str]:
    from .policy import HIDDEN_NAMES

    return HIDDEN_NAMES.get(module, frozenset())


def _literal_format_ok(receiver: ast.expr) -> bool:
    """``"{} rows".format(n)`` is fine; a format field like ``{0.attr}`` or ``{0[k]}`` is not."""
    if not (isinstance(receiver, ast.Constant) and isinstance(receiver.value, str)):
        return False
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(receiver.value) if f is not None]
    except ValueError:
        return False
    specs = [s for _, f, s, _ in string.Formatter().parse(receiver.value) if f is not None and s]
    nested_ok = all(_literal_format_ok(ast.Constant(spec)) for spec in specs if "{" in spec)
    return nested_ok and all("." not in f and "[" not in f for f in fields)
