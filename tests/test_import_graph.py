"""The rooms of the code import downward only (DESIGN.md, "The parts and their rooms").

Every ``import`` in felactl/ counts, also those inside functions and under TYPE_CHECKING: a lazy
import is still a dependency, and hiding a cycle inside a function is how the old
{launcher, agents, worker, profiling} cycle lived on."""

import ast
from pathlib import Path

import pytest

FELACTL = Path(__file__).parent.parent / "felactl"

LEVEL = {
    "errors": 0,
    # base modules; felactl/__init__ is the public API (felactl.TrainJob, __version__)
    "fsutil": 1,
    "limits": 1,
    "machine": 1,
    "job": 1,
    "__init__": 2,
    "spec": 2,
    # peers: none of them imports another
    "control": 3,
    "optimizer": 3,
    "models": 3,
    "agents": 4,  # the per-node agent and the worker runtime
    "profiling": 5,  # measures with the runtime's own parts (its DDP wrapper); started by the launcher
    "testbed": 5,
    "launcher": 6,
    "quickstart": 7,
    "cli": 8,
    "__main__": 9,
}
"""A room may import its own modules and those of rooms at a lower level, nothing else."""


def _room(module: str) -> str:
    """``felactl.agents.worker.loop`` -> ``agents``; ``felactl.__version__`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LEVEL else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    module = "felactl." + ".".join(path.relative_to(FELACTL).with_suffix("").parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name == "felactl":  # from felactl import models, limits
                found += [(node.lineno, f"felactl.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, name))
    return [(line, name) for line, name in found if name == "felactl" or name.startswith("felactl.")]


def _violations() -> list[str]:
    wrong = []
    for path in sorted(FELACTL.rglob("*.py")):
        rel = path.relative_to(FELACTL)
        room = rel.parts[0].removesuffix(".py")
        assert room in LEVEL, f"{rel}: a room DESIGN.md does not name (add it to LEVEL here and to DESIGN)"
        for line, name in _imports(path):
            target = _room(name)
            if target == room:
                continue
            if LEVEL[target] >= LEVEL[room]:
                wrong.append(f"{rel}:{line} ({room}) imports {name} ({target}), a room at its level or above")
    return wrong


def test_no_room_imports_a_room_at_its_level_or_above():
    assert _violations() == []


@pytest.mark.parametrize(
    "room, target", [("agents", "launcher"), ("profiling", "launcher"), ("control", "agents"), ("optimizer", "models")]
)
def test_the_check_sees_an_upward_import(tmp_path, monkeypatch, room, target):
    fake = tmp_path / "felactl"
    (fake / room).mkdir(parents=True)
    (fake / room / "bad.py").write_text(f"def f():\n    from felactl.{target} import x\n")
    monkeypatch.setattr(f"{__name__}.FELACTL", fake)
    assert _violations() == [
        f"{room}/bad.py:2 ({room}) imports felactl.{target} ({target}), a room at its level or above"
    ]
