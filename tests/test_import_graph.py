"""The rooms of the code import downward only (DESIGN.md, "The parts and their rooms").

Every ``import`` in felactl/ counts, also those inside functions and under TYPE_CHECKING: a lazy
import is still a dependency, and hiding a cycle inside a function is how the old
{launcher, agents, worker, profiling} cycle lived on.

A room is a top-level folder of felactl/, except that the worker runtime (``agents/worker/``) is
a room of its own below the per-node agent (``agents/``): counting them as one let the launcher
and profiling import the worker's internals."""

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
    "control": 3,  # the vocabulary launcher, agents and workers share: store protocol, run files
    "optimizer": 3,
    "models": 3,
    "parallel": 3,  # parallelism applied to a plain nn.Module (how felactl wraps a replica in DDP)
    "agents.worker": 4,  # the worker runtime
    "profiling": 4,  # measures with the models and the parallel wrappers; started by the launcher
    "agents": 5,  # the per-node agent: starts, watches and replaces workers
    "testbed": 6,
    "launcher": 7,
    "quickstart": 8,
    "report": 8,  # draws a run from its directory (the launcher's) and its plan (the simulator's)
    "cli": 9,
    "__main__": 10,
}
"""A room may import its own modules and those of rooms at a lower level, nothing else."""

ONLY_FROM = {"agents.worker": {"agents"}}
"""Rooms that only the named rooms may import, however high the importer stands: the agent starts
the workers; the launcher, profiling and the CLI reach them through ``control/`` and the plan."""

STARTS_AGENTS = {
    "felactl.agents.local_node": {"AgentThread", "local_agent_config"},
    "felactl.agents.agent": {"agent_argv", "start_agent"},
}
"""All the launcher takes from ``agents``: what starts an agent, in the launch process for the local
node or as a process elsewhere (ssh, srun). What it says to an agent once started (the job, its
commands, the states it reports, its beat) is ``control/``'s vocabulary."""


def _room(module: str) -> str:
    """``felactl.agents.worker.loop`` -> ``agents.worker``; ``felactl.agents.agent`` -> ``agents``;
    ``felactl.__version__`` -> ``__init__``."""
    parts = module.split(".")
    if parts[1:3] == ["agents", "worker"]:
        return "agents.worker"
    return parts[1] if len(parts) > 1 and parts[1] in LEVEL else "__init__"


def _imports(path: Path) -> list[tuple[int, str, set[str] | None]]:
    """Each felactl import of ``path``: its line, the module, and the names taken from it (None:
    the module itself, ``import felactl.x``)."""
    module = "felactl." + ".".join(path.relative_to(FELACTL).with_suffix("").parts)
    found: list[tuple[int, str, set[str] | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name in ("felactl", "felactl.agents"):  # from felactl import models; from felactl.agents import worker
                found += [(node.lineno, f"{name}.{alias.name}", None) for alias in node.names]
            else:
                found.append((node.lineno, name, {alias.name for alias in node.names}))
    return [(line, name, names) for line, name, names in found if name == "felactl" or name.startswith("felactl.")]


def _violations() -> list[str]:
    wrong = []
    for path in sorted(FELACTL.rglob("*.py")):
        rel = path.relative_to(FELACTL)
        room = "agents.worker" if rel.parts[:2] == ("agents", "worker") else rel.parts[0].removesuffix(".py")
        assert room in LEVEL, f"{rel}: a room DESIGN.md does not name (add it to LEVEL here and to DESIGN)"
        for line, name, names in _imports(path):
            target = _room(name)
            if target == room:
                continue
            if LEVEL[target] >= LEVEL[room]:
                wrong.append(f"{rel}:{line} ({room}) imports {name} ({target}), a room at its level or above")
            elif room not in ONLY_FROM.get(target, {room}):
                wrong.append(f"{rel}:{line} ({room}) imports {name} ({target}), which only {ONLY_FROM[target]} may")
            elif room == "launcher" and target == "agents":
                extra = sorted(names - STARTS_AGENTS.get(name, set())) if names is not None else []
                if names is None or extra:
                    what = f"{', '.join(extra)} from {name}" if extra else name
                    wrong.append(f"{rel}:{line} (launcher) imports {what}: {_AGENT_WORDS}")
    return wrong


_AGENT_WORDS = (
    "the launcher takes only what starts an agent from agents (STARTS_AGENTS); protocol words live in control/"
)


def test_no_room_imports_a_room_at_its_level_or_above():
    assert _violations() == []


@pytest.mark.parametrize(
    "room, target",
    [
        ("agents", "launcher"),
        ("profiling", "launcher"),
        ("control", "agents.agent"),
        ("optimizer", "models"),
        ("agents/worker", "agents.agent"),
        ("profiling", "agents.worker.ddp"),
        ("spec", "agents.worker"),
        ("control", "agents.worker.metrics"),
    ],
)
def test_the_check_sees_an_upward_import(tmp_path, monkeypatch, room, target):
    fake = tmp_path / "felactl"
    (fake / room).mkdir(parents=True)
    (fake / room / "bad.py").write_text(f"def f():\n    from felactl.{target} import x\n")
    monkeypatch.setattr(f"{__name__}.FELACTL", fake)
    importer, imported = room.replace("/", "."), _room(f"felactl.{target}")
    assert _violations() == [
        f"{room}/bad.py:2 ({importer}) imports felactl.{target} ({imported}), a room at its level or above"
    ]


@pytest.mark.parametrize("room", ["launcher", "testbed", "cli", "quickstart"])
def test_only_the_agent_imports_the_worker(tmp_path, monkeypatch, room):
    fake = tmp_path / "felactl"
    for where in (room, "agents"):
        (fake / where).mkdir(parents=True)
        (fake / where / "uses.py").write_text("from felactl.agents.worker.metrics import summarize\n")
    monkeypatch.setattr(f"{__name__}.FELACTL", fake)
    assert _violations() == [
        f"{room}/uses.py:1 ({room}) imports felactl.agents.worker.metrics (agents.worker), which only {{'agents'}} may"
    ]


@pytest.mark.parametrize(
    "line, wrong",
    [
        ("from felactl.agents.agent import start_agent, command_queue", "command_queue from felactl.agents.agent"),
        ("from felactl.agents.node import run_node_agent", "run_node_agent from felactl.agents.node"),
        ("import felactl.agents.agent", "felactl.agents.agent"),
    ],
)
def test_the_launcher_takes_only_what_starts_an_agent_from_agents(tmp_path, monkeypatch, line, wrong):
    fake = tmp_path / "felactl"
    (fake / "launcher").mkdir(parents=True)
    (fake / "launcher" / "starts.py").write_text(
        "from felactl.agents.agent import agent_argv, start_agent\n"
        "from felactl.agents.local_node import AgentThread, local_agent_config\n"
    )
    (fake / "launcher" / "talks.py").write_text(line + "\n")
    monkeypatch.setattr(f"{__name__}.FELACTL", fake)
    assert _violations() == [f"launcher/talks.py:1 (launcher) imports {wrong}: {_AGENT_WORDS}"]
