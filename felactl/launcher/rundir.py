"""The run directory ``runs/<id>/``: one place that knows where each artefact of a run lives.

Layout::

    runs/<id>/
      plan.yaml          the plan used (copied at launch; re-plans append plan.<generation>.yaml;
                         a --script run without a plan has none)
      launch.json        the launch's options
      secret             the job secret, mode 0600
      metrics.jsonl      one record per worker per step
      events.jsonl       joins, leaves, failures, scale changes (with pause_s)
      heartbeat          touched every few seconds while the launch lives (felactl.launcher.liveness)
      summary.json       written at the end
      logs/              one log per worker (and per agent)
      checkpoints/       step<K:06d>/stage<S>.pt, each written atomically (launcher.resume reads them)
      model.pt           the whole model's state_dict, from ``felactl export`` (launcher.export)
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from felactl.control.events import EVENTS_FILE
from felactl.control.metrics import METRICS_FILE
from felactl.errors import InputError
from felactl.fsutil import STORAGE_ERRORS, append_jsonl, atomic_write_text, read_jsonl  # noqa: F401 (re-exported)
from felactl.launcher.liveness import LaunchIdentity, check

if TYPE_CHECKING:
    from felactl.spec import ClusterSpec, ModelSpec

log = logging.getLogger(__name__)
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DEFAULT_RUNS_ROOT = Path("runs")
RESUME_HINT = "continue it from its newest checkpoint with `felactl launch --resume {run}`"
"""What to do about a ``lost`` run (felactl status and felactl scale say it)."""


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid() % 10000:04d}"


def check_run_id(run_id: str) -> str:
    if not RUN_ID_PATTERN.match(run_id):
        raise InputError(f"--run-id {run_id!r}: use letters, digits, '.', '_' or '-' (at most 64)")
    return run_id


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def create(cls, run_id: str | None = None, root: Path = DEFAULT_RUNS_ROOT, *, exist_ok: bool = False) -> RunDir:
        run_id = check_run_id(run_id) if run_id else new_run_id()
        path = Path(root) / run_id
        if path.exists() and not exist_ok:
            raise InputError(f"run {run_id!r} already exists in {root}/ (choose another --run-id, or --resume it)")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir(mode=0o700, exist_ok=True)  # private: it holds the job secret, logs and checkpoints
            for sub in ("logs", "checkpoints"):
                (path / sub).mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise InputError(f"--runs-root {root}: cannot make the run directory {path}: {exc.strerror}") from None
        return cls(path)

    @classmethod
    def find(cls, run: str, root: Path = DEFAULT_RUNS_ROOT) -> RunDir:
        """A run by id (under ``root``) or by path; the newest run when ``run`` is empty."""
        if not run:
            runs = sorted((p for p in Path(root).glob("*") if _is_run(p)), key=_last_written)
            if not runs:
                raise InputError(f"no runs in {root}/")
            return cls(runs[-1])
        for candidate in (Path(run), Path(root) / run):
            if _is_run(candidate):
                return cls(candidate)
        raise InputError(f"no run {run!r} (looked in {root}/ and at that path)")

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def cluster(self) -> Path:
        """The cluster profile the plan was made from, when the launch was given it."""
        return self.path / "cluster.yaml"

    def profiles(self) -> tuple[ClusterSpec, ModelSpec] | None:
        """The profiles the plan was made from, where the launch kept them (``--cluster``,
        ``--model``): a rescale runs the planner again on them."""
        from felactl.spec import load_cluster, load_model

        return (load_cluster(self.cluster), load_model(self.model)) if self.cluster.exists() else None

    @property
    def model(self) -> Path:
        """The model profile the plan was made from, when the launch was given it."""
        return self.path / "model.yaml"

    @property
    def plan(self) -> Path:
        return self.path / "plan.yaml"

    def plan_of(self, generation: int) -> Path:
        """The plan generation ``generation`` ran: the launch's ``plan.yaml`` (generation 0), or
        the copy a re-form, rescale or resume wrote as ``plan.<generation>.yaml``."""
        return self.plan if generation == 0 else self.path / f"plan.{generation}.yaml"

    @property
    def launch_options(self) -> Path:
        return self.path / "launch.json"

    @property
    def secret(self) -> Path:
        return self.path / "secret"

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def events(self) -> Path:
        return self.path / EVENTS_FILE

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def heartbeat(self) -> Path:
        return self.path / "heartbeat"

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Write ``summary.json``; a run directory that cannot take it (read-only, full) does not
        fail a job that ran: a warning says so (the launch prints its summary anyway)."""
        try:
            atomic_write_text(self.summary, json.dumps(summary, indent=2) + "\n")
        except STORAGE_ERRORS as exc:
            log.warning("run %s: its %s was not written (%s)", self.run_id, self.summary, exc)

    def read_summary(self) -> dict[str, Any] | None:
        try:
            summary = json.loads(self.summary.read_text())
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise InputError(f"{self.summary}: is a directory, not the run's summary") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"{self.summary}: not valid JSON ({exc})") from None
        if not isinstance(summary, dict):
            raise InputError(f"{self.summary}: expected a JSON object, got {type(summary).__name__}")
        return summary

    def last_start_or_end(self) -> dict[str, Any] | None:
        """The newest ``launch``, ``resume``, ``failed``, ``stopped`` or ``finished`` event, if any."""
        events = [
            e for e in read_jsonl(self.events) if e.get("kind") in ("launch", "resume", "failed", "stopped", "finished")
        ]
        return events[-1] if events else None

    def state(self) -> str:
        """``created``, ``running``, ``lost``, ``unknown``, ``failed``, ``stopped`` (gracefully: resumable) or ``finished``: see :meth:`run_state`."""
        return self.run_state().name

    def run_state(self) -> RunState:
        """The run's state from the directory alone. A run whose newest event is a launch or a
        resume is ``running`` while that launch process lives, ``lost`` once it is gone without
        recording an end (killed, its machine lost), ``unknown`` where it left no evidence either
        way (see :mod:`felactl.launcher.liveness`). A run that failed and was resumed is running again."""
        summary = self.read_summary()
        if summary is not None:  # a --script run's summary says how its script ended
            return RunState("finished" if summary.get("exit_code", 0) == 0 else "failed")
        last = self.last_start_or_end()
        if last is None:
            return RunState("created")
        if last["kind"] not in ("launch", "resume"):
            return RunState(last["kind"])
        liveness = check(LaunchIdentity.from_dict(last.get("launcher")), self.heartbeat)
        return RunState({"alive": "running", "gone": "lost", "unknown": "unknown"}[liveness.verdict], liveness.reason)


def _last_written(path: Path) -> float:
    """When a run last recorded something: its newest metrics or events (the directory's own
    mtime also moves when `felactl report` adds its report/ there)."""
    stamps = [f.stat().st_mtime for f in (path / "metrics.jsonl", path / "events.jsonl") if f.exists()]
    return max(stamps, default=path.stat().st_mtime)


def _is_run(path: Path) -> bool:
    """A plan's run has its plan; a --script run may have none, but has its launch options."""
    return (path / "plan.yaml").exists() or (path / "launch.json").exists()


@dataclass(frozen=True, slots=True)
class RunState:
    name: str
    """``created``, ``running``, ``lost``, ``unknown``, ``failed`` or ``finished``."""
    reason: str = ""
    """Why a run is ``lost`` or ``unknown``: one clause for the user."""
