"""The run directory ``runs/<id>/``: one place that knows where each artefact of a run lives.

Layout::

    runs/<id>/
      plan.yaml          the plan used (copied at launch; re-plans append plan.<generation>.yaml)
      secret             the job secret, mode 0600
      metrics.jsonl      one record per worker per step
      events.jsonl       joins, leaves, failures, scale changes (with pause_s)
      summary.json       written at the end
      logs/              one log per worker (and per agent)
      checkpoints/       step-<N>.pt, written atomically; ``latest`` names the newest complete one
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from felactl.errors import InputError
from felactl.fsutil import append_jsonl, atomic_write_text, read_jsonl  # noqa: F401 (re-exported)

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DEFAULT_RUNS_ROOT = Path("runs")


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
    def create(cls, run_id: str | None = None, root: Path = DEFAULT_RUNS_ROOT, *, exist_ok: bool = False) -> "RunDir":
        run_id = check_run_id(run_id) if run_id else new_run_id()
        path = Path(root) / run_id
        if path.exists() and not exist_ok:
            raise InputError(f"run {run_id!r} already exists in {root}/ (choose another --run-id, or --resume it)")
        for sub in ("logs", "checkpoints"):
            (path / sub).mkdir(parents=True, exist_ok=True)
        return cls(path)

    @classmethod
    def find(cls, run: str, root: Path = DEFAULT_RUNS_ROOT) -> "RunDir":
        """A run by id (under ``root``) or by path; the newest run when ``run`` is empty."""
        if not run:
            runs = sorted((p for p in Path(root).glob("*") if (p / "plan.yaml").exists()),
                          key=lambda p: p.stat().st_mtime)
            if not runs:
                raise InputError(f"no runs in {root}/")
            return cls(runs[-1])
        for candidate in (Path(run), Path(root) / run):
            if (candidate / "plan.yaml").exists():
                return cls(candidate)
        raise InputError(f"no run {run!r} (looked in {root}/ and at that path)")

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def cluster(self) -> Path:
        """The cluster profile the plan was made from, when the launch was given it."""
        return self.path / "cluster.yaml"

    @property
    def model(self) -> Path:
        """The model profile the plan was made from, when the launch was given it."""
        return self.path / "model.yaml"

    @property
    def plan(self) -> Path:
        return self.path / "plan.yaml"

    @property
    def secret(self) -> Path:
        return self.path / "secret"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.summary, json.dumps(summary, indent=2) + "\n")

    def read_summary(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.summary.read_text())
        except FileNotFoundError:
            return None

    def last_start_or_end(self) -> dict[str, Any] | None:
        """The newest ``launch``, ``resume``, ``failed`` or ``finished`` event, if any."""
        events = [e for e in read_jsonl(self.events) if e.get("kind") in ("launch", "resume", "failed", "finished")]
        return events[-1] if events else None

    def state(self) -> str:
        """``created``, ``running``, ``failed`` or ``finished``, from the directory alone (a run
        that failed and was resumed is running again)."""
        if self.read_summary() is not None:
            return "finished"
        last = self.last_start_or_end()
        if last is None:
            return "created"
        return "running" if last["kind"] in ("launch", "resume") else last["kind"]
