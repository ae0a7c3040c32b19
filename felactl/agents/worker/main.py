"""One worker's life: ``membership.start() -> train(trainer, strategy, membership) -> membership.finish()``.

Every worker runs this one sequence; what differs between a job of fixed members and an elastic
one is the :class:`~felactl.agents.worker.membership.Membership` it runs it with, chosen here
from its settings (``FELACTL_ELASTIC``, which the agent sets from its assignment).
"""

from __future__ import annotations

import faulthandler
import signal
import time
from typing import Any

from felactl.agents.worker.config import WorkerConfig
from felactl.agents.worker.elastic import ElasticMembership
from felactl.agents.worker.fixed import FixedMembership
from felactl.agents.worker.loop import train
from felactl.agents.worker.membership import Membership


def membership_for(cfg: WorkerConfig) -> Membership:
    """The membership this worker runs: elastic when its agent says the job is elastic."""
    return ElasticMembership(cfg) if cfg.elastic else FixedMembership(cfg)


def run_worker(cfg: WorkerConfig) -> dict[str, Any]:
    """Join the job, train to the end (or until this worker leaves it), write the summary; returns
    this worker's totals."""
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: where is a stuck worker?
    membership = membership_for(cfg)
    try:
        trainer, strategy = membership.start()
        start = time.perf_counter()
        finished = train(trainer, strategy, membership)
        return membership.finish(finished, time.perf_counter() - start)
    finally:
        membership.close()
