"""The rooms stay readable (issue 31, item 4): no module of felactl over 500 lines, no function
whose body is over 60. A body runs from its first statement after the docstring to its end, so a
typer command's parameter list does not count (the house rule: typer's parameter lists may be long,
their bodies may not). A module that grows past the bound is split by what it does, not trimmed."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "felactl"
MAX_MODULE_LINES = 500
MAX_BODY_LINES = 60


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    body = node.body
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    if has_docstring and isinstance(body[0].value.value, str) and len(body) > 1:
        body = body[1:]
    return node.end_lineno - body[0].lineno + 1


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_body_is_over_60_lines():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > MAX_BODY_LINES:
                long[f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"] = _body_lines(node)
    assert not long, f"function bodies over {MAX_BODY_LINES} lines: {long}"


def test_the_bounds_are_checked_on_real_code():
    """The walk sees the package (not an empty directory) and measures a body as the rule says."""
    assert len(_modules()) > 50
    tree = ast.parse('def f(a,\n      b):\n    """Doc."""\n    x = 1\n    return x\n')
    assert _body_lines(tree.body[0]) == 2
