"""felactl's built-in ``mlp`` as a user model (``_gated_models:gated_mlp``) whose pace a test holds
back with a gate file: while the file named by ``$FELACTL_TEST_GATE`` exists, every batch waits
:data:`PAUSE_S` first; once it is gone (or when the variable is unset) batches come at full speed.
A job paced so outlives whatever a test does to it, and finishes its remaining steps the moment the
test removes the gate. The wait changes no number: a gated job trains exactly as an ungated one."""

from __future__ import annotations

import dataclasses
import os
import time

from felactl import TrainJob, models

GATE_ENV = "FELACTL_TEST_GATE"
PAUSE_S = 0.15
"""Per batch: a worker of a two-worker data-parallel plan of micro-batch ``global_batch / 4``
takes two batches a step, so a gated step takes about 0.3 s."""


def gated_mlp(**config) -> TrainJob:
    job = models.build("mlp", config).job
    gate = os.environ.get(GATE_ENV)
    if not gate:
        return job
    collate = job.collate_fn

    def paced(samples):
        if os.path.exists(gate):
            time.sleep(PAUSE_S)
        return collate(samples)

    return dataclasses.replace(job, collate_fn=paced)
