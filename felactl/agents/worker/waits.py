"""How a worker waits on the others through the store: in slices, so that a wait on a worker that
died ends (the trainer's, :class:`Waits`)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from felactl.errors import WorkerFailed

WAIT_SLICE_S = 0.25
"""How often a wait on the others looks up whether the job's members changed under it."""


class Waits:
    """The trainer's waits on the others (:class:`~felactl.agents.worker.engine.Trainer` is one):
    they need its ``runtime`` (the store timeout), ``membership`` (whether the members changed)
    and ``worker_id``."""

    def wait_for_key(self, store: dist.Store, key: str, unless: Callable[[], None] = lambda: None) -> None:
        """Block until another worker sets ``key`` (:meth:`wait_in_slices`)."""
        self.wait_in_slices(
            lambda: store.wait([key], datetime.timedelta(seconds=WAIT_SLICE_S)), f"nobody wrote {key}", unless
        )

    def wait_in_slices(self, wait: Callable[[], Any], what: str, unless: Callable[[], None] = lambda: None) -> Any:
        """``wait()``'s result, ``wait`` a store call that times out (RuntimeError) after
        :data:`WAIT_SLICE_S`. A worker that would answer may have died: give up as a collective with
        a dead peer does (RuntimeError) once the members changed under the wait (an elastic job
        re-forms without it) or ``unless()`` raises; fail after the store timeout."""
        deadline = time.monotonic() + self.runtime.cfg.timeout_s
        while True:
            try:
                return wait()
            except RuntimeError:  # this slice timed out
                unless()
                self._give_up_if_stuck(deadline, what)

    def join_thread(self, thread, what: str) -> None:
        """Join a helper thread that waits on the others (a scheduler), giving up as :meth:`wait_for_key` does."""
        deadline = time.monotonic() + self.runtime.cfg.timeout_s
        while thread.is_alive():
            thread.join(WAIT_SLICE_S)
            if thread.is_alive():
                self._give_up_if_stuck(deadline, what)

    def _give_up_if_stuck(self, deadline: float, what: str) -> None:
        if self.membership.members_changed():
            raise RuntimeError(f"worker {self.worker_id}: {what}, and the job's members changed")
        if time.monotonic() > deadline:
            raise WorkerFailed(f"worker {self.worker_id}: {what} within {self.runtime.cfg.timeout_s:g} s")
