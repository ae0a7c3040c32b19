"""The rooms stay readable (issue 31, item 4): no module of felactl over 500 lines, no function over
60. A function counts from its first line (its first decorator, else its ``def``) to its last: the
signature and the docstring count. A typer command keeps its parameter list short by taking an
options dataclass (:func:`felactl.cli.options.takes_options`). A module or a function that grows
past the bound is split by what it does, not trimmed."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "felactl"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text())
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
    return node.end_lineno - first + 1


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_60_lines():
    long = {
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}": _function_lines(node)
        for path in _modules()
        for node in _functions(path)
        if _function_lines(node) > MAX_FUNCTION_LINES
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (decorators, signature and docstring included): {long}"


def test_the_bounds_are_checked_on_real_code():
    """The walk sees the package (not an empty directory), the typer commands among its functions,
    and measures a function as Python's own source lookup bounds it: decorators to last line."""
    from felactl.cli import options

    assert len(_modules()) > 50
    commands = {node.name for path in (PACKAGE / "cli").glob("*.py") for node in _functions(path)}
    assert {"launch", "plan", "profile", "agent"} <= commands
    [takes_options] = [node for node in _functions(PACKAGE / "cli" / "options.py") if node.name == "takes_options"]
    assert _function_lines(takes_options) == len(inspect.getsourcelines(options.takes_options)[0])
    tree = ast.parse('@first\n@second(\n  1)\ndef f(a,\n      b):\n    """Doc."""\n    x = 1\n    return x\n')
    assert _function_lines(tree.body[0]) == 8
