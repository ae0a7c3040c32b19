"""A graceful stop: the workers agree on a last step, checkpoint it and exit 0.

``felactl launch`` interrupted (Ctrl-C, SIGTERM) tells its agents to *drain*: each sends its
workers SIGINT and waits a while before it kills them. A worker that got the signal proposes a
last step a few steps past its own (its strategy's ``lead_steps``: more than any replica can be
ahead of another, so nobody has passed it yet); the first proposal in the store wins and every
worker reads the same one, so they all leave the loop after the same completed step, which then
is checkpointed.
Workers that run at their own pace (WBSP, SDPipe) need no agreement: they stop claiming samples.
The proposal is a signed document (:class:`LastStepDoc`): a forged one in its place is ignored,
recorded, and replaced by a worker's own proposal.
"""

from __future__ import annotations

import signal
import threading

from felactl.control import Reader, keys
from felactl.control.documents import LastStepDoc

_asked = threading.Event()


def listen() -> None:
    """Take SIGINT as a request to drain, from now on (the worker's entry calls it first thing;
    before it, an agent's SIGINT is lost or ends the process, so the agent repeats it)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda signum, frame: _asked.set())


class Drain:
    def __init__(self, reader: Reader, key: str = keys.LAST_STEP):
        """``reader``: the job's store (shared by every worker of the job, whatever its generation);
        ``key``: where the last step is agreed (:func:`felactl.control.keys.last_step`)."""
        self.reader, self.key = reader, key
        self.last_step: int | None = None
        listen()

    @property
    def signalled(self) -> bool:
        return _asked.is_set()

    def last(self, steps_done: int, lead_steps: int) -> int | None:
        """The agreed last step (steps done), once anyone asked for a stop; else None. One store
        look-up per call: a worker whose agent has not signalled it yet still learns the step.
        A signalled worker proposes ``steps_done + lead_steps``."""
        if self.last_step is None:
            if self.signalled:
                agreed = self.reader.agree(
                    self.key, LastStepDoc.KIND.value, LastStepDoc(steps_done + lead_steps).to_body()
                )
                self.last_step = LastStepDoc.from_body(agreed).step
            else:
                opened = self.reader.read(self.key, LastStepDoc.KIND.value)
                if opened is not None:
                    self.last_step = LastStepDoc.from_body(opened.body).step
        return self.last_step

    def stop_after(self, steps_done: int, lead_steps: int) -> bool:
        last = self.last(steps_done, lead_steps)
        return last is not None and steps_done >= last

    def requested(self) -> bool:
        """For workers at their own pace: has anyone asked for a stop? (Then claim nothing more.)
        A signalled one still proposes, so that the others learn of the stop; the step is no one's
        (they stop where their claims run out)."""
        return self.last(0, lead_steps=0) is not None
