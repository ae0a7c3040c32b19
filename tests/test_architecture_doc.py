"""ARCHITECTURE.md walks the code hop by hop, each hop a ``path.py:name`` (or
``path.py:Class.method``) under felactl/, and a test a ``tests/path.py::test``. Every such
reference must name something that exists, so a rename or a merge that leaves the walk stale
fails here instead of misleading its reader."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
DOC = ROOT / "ARCHITECTURE.md"

CODE_REFERENCE = re.compile(r"([\w/]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
"""``launcher/elastic.py:ElasticController.poll``; a ``::`` (a test) or a line number does not match."""

TEST_REFERENCE = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def _defined(tree: ast.Module | ast.ClassDef) -> dict[str, ast.AST]:
    """The names a module or a class body binds: functions, classes, assignments and fields."""
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update((t.id, node) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def resolve(base: Path, path: str, qualname: str) -> str | None:
    """Why ``path:qualname`` names nothing under ``base``, or None when it names something."""
    file = base / path
    if not file.is_file():
        return f"{path}: no such file under {base.name}/"
    scope: ast.AST = ast.parse(file.read_text(), str(file))
    for i, part in enumerate(qualname.split(".")):
        if not isinstance(scope, ast.Module | ast.ClassDef):
            return f"{path}:{qualname}: {'.'.join(qualname.split('.')[:i])} is not a class"
        found = _defined(scope).get(part)
        if found is None:
            return f"{path}:{qualname}: no {part!r} there"
        scope = found
    return None


def stale_references(text: str) -> list[str]:
    stale = [resolve(ROOT / "felactl", path, name) for path, name in CODE_REFERENCE.findall(text)]
    stale += [resolve(ROOT, path, name) for path, name in TEST_REFERENCE.findall(text)]
    return [why for why in stale if why]


def test_every_hop_of_the_walk_names_code_that_exists():
    text = DOC.read_text()
    assert len(CODE_REFERENCE.findall(text)) > 100  # the walk is still written as path.py:name
    assert stale_references(text) == []


def test_a_stale_hop_is_seen():
    assert stale_references("`launcher/follow.py:follow` and `launcher/follow.py:_gone`") == [
        "launcher/follow.py:_gone: no '_gone' there"
    ]
    assert stale_references("`launcher/elastic.py:ElasticController.nope`") == [
        "launcher/elastic.py:ElasticController.nope: no 'nope' there"
    ]
    assert stale_references("`launcher/nowhere.py:f`") == ["launcher/nowhere.py: no such file under felactl/"]
    assert stale_references("`tests/test_architecture_doc.py::test_gone`") == [
        "tests/test_architecture_doc.py:test_gone: no 'test_gone' there"
    ]
