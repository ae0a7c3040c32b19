"""The kinds of event a run records in ``events.jsonl``, and the one way to record a refusal."""

from __future__ import annotations

import enum
import logging
import time
from pathlib import Path

from felactl.fsutil import append_jsonl

log = logging.getLogger(__name__)
EVENTS_FILE = "events.jsonl"
"""A run's events, in its directory."""


class EventKind(str, enum.Enum):
    LAUNCH = "launch"
    RESUME = "resume"
    START = "start"
    RESTART = "restart"
    NODE_JOINED = "node-joined"
    SCALE_OUT = "scale-out"
    SCALE_IN = "scale-in"
    FAILURE = "failure"
    RE_FORM = "re-form"
    REFUSED = "refused"
    """A request refused, or a forged document ignored (``key`` and ``reason`` say which and why)."""
    REPAIRED = "repaired"
    """A key the coordinator owns was deleted or changed; it was written back from the coordinator's state."""
    STOPPED = "stopped"
    FINISHED = "finished"
    FAILED = "failed"
    CHECKPOINT_FAILED = "checkpoint-failed"
    """A worker could not write a checkpoint (the storage failed); training went on."""
    SLURM_NODES = "slurm-nodes"
    """``felactl scale --slurm-nodes``: Slurm granted a job of nodes, whose workers joined (``job``, ``nodes``, ``workers``)."""
    SLURM_RELEASED = "slurm-released"
    """Those nodes' workers were all removed and their Slurm job cancelled (``job``, ``nodes``)."""

    def __str__(self) -> str:
        return self.value


def record(events: Path | None, kind: EventKind, **fields) -> None:
    """Append an event (``events`` None: only log it, e.g. a coordinator without a run directory)."""
    event = {"time": time.time(), "kind": kind.value, **fields}
    if kind in (EventKind.REFUSED, EventKind.REPAIRED):
        where = f" {fields['key']}" if fields.get("key") else ""  # a refused scale request names no key
        log.warning("control plane: %s%s: %s", kind.value, where, fields.get("reason", ""))
    if events is not None:
        write_event(Path(events), event)


def write_event(events: Path, event: dict) -> None:
    """Append ``event`` (with its ``time`` and ``kind``) to ``events``; where it cannot be written
    (a worker on a node without the run directory, a read-only or full disk) a log line says so
    and the job goes on."""
    try:
        append_jsonl(events, event)
    except OSError as exc:
        log.warning("could not record %s in %s: %s", event.get("kind"), events, exc)


REFUSALS_PER_KEY = 20
"""Refusals recorded per key: past it, one more line says the rest are not (someone writing
forgeries in a loop must not fill the disk)."""


class RefusalLog:
    """Records forgeries as ``refused`` events, at most :data:`REFUSALS_PER_KEY` per key."""

    def __init__(self, events: Path | None, **fields):
        self.events, self.fields = events, fields
        self.counts: dict[str, int] = {}

    def __call__(self, key: str, reason: str) -> None:
        count = self.counts[key] = self.counts.get(key, 0) + 1
        if count <= REFUSALS_PER_KEY:
            record(self.events, EventKind.REFUSED, key=key, reason=reason, **self.fields)
        elif count == REFUSALS_PER_KEY + 1:
            record(
                self.events,
                EventKind.REFUSED,
                key=key,
                reason=f"{reason} (and more: further refusals at this key are not recorded)",
                **self.fields,
            )
