"""gpt-mini as a user's TrainJob whose pace a test holds: ``_paced_job:gpt_mini``.

A test that needs a job to outlive its ``felactl scale`` calls (a newcomer's start-up takes 3-9 s
here, more on a loaded machine) used to give it a step count that covered the slowest start-up at
full speed, and then waited for the rest of those steps. Instead, while the test's ``pace_file``
exists, every sample from global index ``slow_from`` on takes ``sample_s`` longer to load: the
job goes on at about a step a second, its workers mostly asleep (so a newcomer's start-up gets
the cores), and once the test removes the file it trains its last steps at full speed. Nothing
else changes: the model, its initial weights, the data and its order are gpt-mini's.
"""

from __future__ import annotations

import dataclasses
import os
import time

from felactl import models


class PacedSamples:
    """``samples`` (a map-style dataset), each from index ``slow_from`` on slowed while ``pace_file`` exists."""

    def __init__(self, samples, pace_file: str, slow_from: int, sample_s: float):
        self.samples, self.pace_file, self.slow_from, self.sample_s = samples, pace_file, slow_from, sample_s

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        if index >= self.slow_from and os.path.exists(self.pace_file):
            time.sleep(self.sample_s)
        return self.samples[index]


def gpt_mini(depth: int, width: int, pace_file: str, slow_from: int, sample_s: float = 0.1):
    """gpt-mini of ``depth`` and ``width`` as felactl builds it with seed 0 (every test plan's), its samples paced."""
    job = models.build("gpt-mini", {"depth": depth, "width": width}).job
    return dataclasses.replace(job, dataset=PacedSamples(job.dataset, pace_file, slow_from, sample_s))
