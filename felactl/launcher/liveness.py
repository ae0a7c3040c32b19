"""Is a run's launch process still there? The evidence a launch leaves, and the judgement of it.

A launch records who it is in its ``launch``/``resume`` event (``launcher``: host, pid, the
process's start time and its pid namespace) and touches ``runs/<id>/heartbeat`` every
:data:`HEARTBEAT_S` while it lives (a thread, so it beats while the launch waits for agents too).

A reader on the same host and in the same pid namespace asks the kernel: the pid alive with the
recorded start time is the launch (a recycled pid has a later start time); anything else means
the launch is gone, at once. A reader elsewhere (another node sharing the runs directory, a
container with a pid namespace of its own) can only read the heartbeat's age: older than
:data:`LOST_AFTER_S` means gone. That bound leaves room for about 15 missed beats, for clock skew
between hosts and for a network file system's attribute cache (seconds, for a file that changes
this often).

Run directories from before this evidence existed have none: their liveness is ``unknown``.
The judgement (:func:`judge`) is pure; :func:`check` gathers what it needs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

from felactl.machine import short_hostname

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0
"""How often a live launch touches its run's heartbeat file."""
LOST_AFTER_S = 30.0
"""A heartbeat older than this (seen from another host or pid namespace) means the launch is gone."""
START_TOLERANCE_S = 1.0
"""How far a process's start time may read from the recorded one and still be the launch: the
kernel derives it from the boot time, which clock adjustments move a little. A recycled pid
cannot fall inside it: its process started after the launch died, not within a second of the
launch's own start."""


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux, or no /proc
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchIdentity:
    """Who a launch process is, recorded so that a later reader can tell whether it still runs."""

    host: str
    """``short_hostname()`` of the launch's machine."""
    pid: int
    started: float
    """The process's start time (``psutil.Process.create_time``, seconds since the epoch)."""
    pid_ns: str | None = None
    """Its pid namespace (``/proc/self/ns/pid``): a pid means something only inside it."""

    @classmethod
    def of_this_process(cls) -> LaunchIdentity:
        return cls(
            host=short_hostname(), pid=os.getpid(), started=psutil.Process().create_time(), pid_ns=_pid_namespace()
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> LaunchIdentity | None:
        """The identity recorded in an event; None where there is none (older runs) or it is malformed."""
        if not isinstance(data, dict):
            return None
        try:
            return cls(
                host=str(data["host"]), pid=int(data["pid"]), started=float(data["started"]), pid_ns=data.get("pid_ns")
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class Liveness:
    verdict: Literal["alive", "gone", "unknown"]
    reason: str = ""
    """Why, for a verdict other than ``alive``: one clause for the user."""


def judge(
    identity: LaunchIdentity | None, *, same_machine: bool, observed_start: float | None, heartbeat_age_s: float | None
) -> Liveness:
    """Whether the launch ``identity`` still runs (pure).

    ``same_machine``: the reader shares the launch's host and pid namespace; ``observed_start``:
    the start time of the live process that now has the launch's pid there (None: no such
    process); ``heartbeat_age_s``: seconds since the heartbeat file was touched (None: no file).
    """
    if identity is None:
        return Liveness("unknown", "its launch recorded no evidence of life (a run from an older felactl)")
    where = f"pid {identity.pid} on {identity.host}"
    if same_machine:
        if observed_start is not None and abs(observed_start - identity.started) <= START_TOLERANCE_S:
            return Liveness("alive")
        return Liveness("gone", f"its launch process ({where}) is gone")
    if heartbeat_age_s is None:
        return Liveness("unknown", f"its launch ({where}) left no heartbeat file to tell whether it runs")
    if heartbeat_age_s > LOST_AFTER_S:
        return Liveness(
            "gone",
            f"its launch ({where}) has not touched its heartbeat for {heartbeat_age_s:.0f} s "
            f"(more than {LOST_AFTER_S:.0f} s)",
        )
    return Liveness("alive")


def check(identity: LaunchIdentity | None, heartbeat: Path) -> Liveness:
    """:func:`judge` on what this machine can see of ``identity`` and its ``heartbeat`` file."""
    same_machine = identity is not None and identity.host == short_hostname() and identity.pid_ns == _pid_namespace()
    observed_start = None
    if same_machine:
        try:
            observed_start = _start_time(identity.pid)
        except psutil.AccessDenied:  # the kernel will not say (another user's process): go by the heartbeat
            same_machine = False
    try:
        heartbeat_age_s: float | None = max(0.0, time.time() - heartbeat.stat().st_mtime)
    except OSError:
        heartbeat_age_s = None
    return judge(identity, same_machine=same_machine, observed_start=observed_start, heartbeat_age_s=heartbeat_age_s)


def _start_time(pid: int) -> float | None:
    """The start time of the live process ``pid`` (None: none, or a zombie: dead but not reaped)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except psutil.NoSuchProcess:
        return None


class Heartbeat:
    """Touches ``path`` every :data:`HEARTBEAT_S` from a daemon thread until :meth:`stop`."""

    def __init__(self, path: Path):
        self.path = path
        self._stopped = threading.Event()
        self._touch()  # the file exists before anyone reads the event that points to it
        self._thread = threading.Thread(target=self._run, name="felactl-heartbeat", daemon=True)
        self._thread.start()

    def _touch(self) -> bool:
        try:
            self.path.touch()
            return True
        except OSError as exc:
            log.warning("could not touch %s (%s); felactl status elsewhere may call this run lost", self.path, exc)
            return False

    def _run(self) -> None:
        while not self._stopped.wait(HEARTBEAT_S):
            if not self._touch():
                return  # warned once; the launch goes on

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=HEARTBEAT_S)
