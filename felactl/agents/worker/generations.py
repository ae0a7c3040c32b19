"""How an elastic worker follows the job's membership generations.

The coordinator (:mod:`felactl.launcher.elastic`) publishes generation ``G`` as a signed document
under ``<job prefix>elastic/gen/<G>`` (members' worker ids in rank order, the plan file, its
kind) and then bumps the key ``generation``. Each worker's :class:`Heartbeat` thread says it is
alive (``hb/<id>``, with its step) and watches that key off the training thread, so the loop
reads the newest generation from memory; :func:`read_generation` reads a document, verified.
"""

from __future__ import annotations

import os
import threading
import time

from felactl.agents.worker.config import WorkerConfig
from felactl.agents.worker.runtime import connect_store
from felactl.control import keys
from felactl.control.documents import GenerationDoc, HeartbeatDoc
from felactl.control.seal import parse_int

PLANNED = ("scale-out", "scale-in")
"""The kinds of generation the coordinator forms on request (the others re-form after a failure)."""


def elastic_prefix(store_prefix: str) -> str:
    """Where the elastic keys of a job live (the coordinator writes ``<job prefix>elastic/...``)."""
    return store_prefix + keys.ELASTIC.rstrip("/")


class Heartbeat(threading.Thread):
    """On its own store connection: sets ``hb/<id>`` (a growing counter and this worker's step)
    every ``FELACTL_HEARTBEAT_S``, and watches the ``generation`` key every ``WATCH_S``, so the
    training loop reads the newest generation from memory instead of asking the store each step."""

    WATCH_S = 0.1

    def __init__(self, cfg: WorkerConfig):
        super().__init__(name="felactl-heartbeat", daemon=True)
        raw = connect_store(cfg.store_host, cfg.store_port, is_master=False, timeout_s=cfg.timeout_s)
        self.reader = cfg.reader(raw)
        self.key, self.interval_s = keys.heartbeat(cfg.worker_id), cfg.heartbeat_s
        self.step = -1
        """This worker's steps done, said in each beat (:meth:`say_step`); -1 until it has started."""
        self._say_now: threading.Event | None = None
        """Set by :meth:`say_started`: beat at once, then set it."""
        self.generation = cfg.generation
        self.docs: dict[int, dict] = {}
        """Generation -> its verified document (what the training thread switches to)."""
        self.watch()
        self.stopped = threading.Event()
        self.cpu_s = 0.0
        """CPU seconds this thread has used: the steady-state cost of being elastic (the training
        loop's own generation check rides on BSP's arrival all-reduce, which it does anyway)."""

    def say_step(self, step: int) -> None:
        """Say ``step`` (this worker's steps done) in the next beats."""
        self.step = step

    def say_started(self, step: int) -> None:
        """Say ``step`` now and return once it is on the store: the coordinator reads a beat with
        a step as "this worker has started", and must not miss it when the worker fails a few
        milliseconds later (a node that could not start is told apart by it)."""
        said = threading.Event()
        self.step, self._say_now = step, said
        said.wait(max(5.0, 4 * self.WATCH_S))  # a thread that has ended (the coordinator gone) never says it

    def run(self) -> None:
        count, next_beat = 0, 0.0
        while not self.stopped.is_set():
            try:
                say_now = self._say_now
                if say_now is not None or time.monotonic() >= next_beat:
                    count += 1
                    self.reader.write(
                        self.key,
                        HeartbeatDoc.KIND.value,
                        HeartbeatDoc(n=count, step=self.step, pid=os.getpid()).to_body(),
                        generation=self.generation,
                    )
                    next_beat = time.monotonic() + self.interval_s
                    if say_now is not None:
                        self._say_now = None
                        say_now.set()
                self.watch()
            except RuntimeError:
                return  # the coordinator is gone; the main thread will notice too
            self.cpu_s = time.thread_time()
            self.stopped.wait(self.WATCH_S)

    def watch(self) -> None:
        """Take the ``generation`` hint when a valid signed document backs it; a number without one
        (a deleted, bumped or forged key) is ignored: the coordinator writes the true one back."""
        hint = parse_int(self.reader.raw(keys.GENERATION))
        if hint is not None and hint > self.generation:
            doc = self.docs.get(hint) or read_generation(self.reader, hint)
            if doc is not None:
                self.docs[hint] = doc
                self.generation = hint


def read_generation(reader, generation: int) -> dict | None:
    """The verified document of ``generation`` (its body), or None: absent, or a forgery (recorded)."""
    doc = reader.read_doc(keys.generation_document(generation), GenerationDoc, generation=generation)
    return doc.to_body() if doc is not None and doc.generation == generation else None
