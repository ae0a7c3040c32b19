"""One worker's life: ``membership.start() -> train(trainer, strategy, membership) -> membership.finish()``.

Every worker runs this one sequence; what differs between a job of fixed members and an elastic
one is the :class:`~felactl.agents.worker.membership.Membership` it runs it with, chosen here
from its settings (``FELACTL_ELASTIC``, which the agent sets from its assignment).
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import time
from typing import Any

from felactl.agents.worker.config import WorkerConfig
from felactl.agents.worker.elastic import ElasticMembership
from felactl.agents.worker.fixed import FixedMembership
from felactl.agents.worker.loop import train
from felactl.agents.worker.membership import Membership

SWITCH_INTERVAL_S = 1e-4
"""How long a worker's running thread keeps the GIL once another thread asks for it (Python's
default: 5 ms). A worker's helper threads answer other workers: the flexible hybrid's token
server (in rank 0) and tensor servers, WBSP's and SDPipe's, the tree buckets. Woken by a request,
such a thread waits for the GIL while the main thread runs Python (its own token handling, the
loop), up to the interval, and a request takes two such waits. With the main thread busy in
Python, the token server's answer took 40 ms a token at 5 ms, 9.3 at 1 ms, 3.0 at 0.1 ms (2.0 with
the main thread idle): ``benchmarks/bench_token_server.py --server-main python``, BENCHMARKS.md.
Inside torch's kernels the GIL is free, so compute pays nothing for it."""


def membership_for(cfg: WorkerConfig) -> Membership:
    """The membership this worker runs: elastic when its agent says the job is elastic."""
    return ElasticMembership(cfg) if cfg.elastic else FixedMembership(cfg)


def run_worker(cfg: WorkerConfig) -> dict[str, Any]:
    """Join the job, train to the end (or until this worker leaves it), write the summary; returns
    this worker's totals."""
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: where is a stuck worker?
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    membership = membership_for(cfg)
    try:
        trainer, strategy = membership.start()
        start = time.perf_counter()
        finished = train(trainer, strategy, membership)
        return membership.finish(finished, time.perf_counter() - start)
    finally:
        membership.close()
