"""``felactl launch --tensorboard DIR``: the run's scalars for TensorBoard, written as its workers
record them (``torch.utils.tensorboard``; the ``tensorboard`` package, ``pip install
'felactl[tensorboard]'``).

Per step, at the step's end: ``train/loss`` (sample-weighted over the step's records),
``train/samples_per_s`` (the first stage's samples over the time since the previous step ended),
``train/lr``; per worker ``worker/<rank>/share`` (its part of the step's samples),
``worker/<rank>/wait_s`` and ``worker/<rank>/compute_s``; and ``eval/<name>`` for what the job's
``evaluate`` hook returned. A step is written once every worker recording has passed it (workers
at their own pace, under wbsp and sdpipe, record steps out of order; a worker counts from its
first record), the rest when the launch
ends. Anything going wrong here is said once and ends the following, never the training.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from felactl.control.metrics import step_losses
from felactl.errors import InputError
from felactl.fsutil import check_directory

log = logging.getLogger(__name__)
RECENT_S = 30.0
"""A worker that recorded nothing for this long no longer holds a step back from being written."""


class TensorBoardFollower:
    """Follows a run's ``metrics.jsonl`` into TensorBoard event files in ``log_dir``; call it with
    the launcher's state on every update (the launch's ``on_update``), :meth:`close` at its end."""

    def __init__(self, log_dir: Path):
        check_directory("--tensorboard", log_dir)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise InputError(
                "--tensorboard: the tensorboard package is not installed (pip install 'felactl[tensorboard]')"
            ) from None
        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.metrics: Path | None = None
        self.offset = 0
        self.pending: dict[int, list[dict[str, Any]]] = {}
        self.last_end: float | None = None
        self.latest: dict[int, tuple[int, float]] = {}
        """Each worker's newest step and when it recorded it."""
        self.failed = False

    def __call__(self, state) -> None:
        """Follow the run; whatever goes wrong here (a damaged record, a full disk) is said once
        and ends the following, never the training."""
        if self.failed:
            return
        try:
            self.follow(state.run.metrics)
        except Exception as exc:  # TensorBoard is a view: the run goes on without it
            self.failed = True
            log.warning("--tensorboard: stopped writing (%s: %s); the run goes on", type(exc).__name__, exc)

    def follow(self, metrics: Path, final: bool = False) -> None:
        """Read the records added since the last call; write the steps every worker recording
        now has passed (all: ``final``)."""
        self.metrics = metrics
        for record in self._new_records(metrics):
            self.pending.setdefault(record["step"], []).append(record)
            self.latest[record["rank"]] = (
                max(self.latest.get(record["rank"], (-1, 0.0))[0], record["step"]),
                record["time"],
            )
        newest_time = max((t for _, t in self.latest.values()), default=0.0)
        # a worker silent for RECENT_S has left (or lags far behind): it holds no step back
        recording = [step for step, t in self.latest.values() if newest_time - t <= RECENT_S]
        passed = min(recording, default=-1)
        for step in sorted(self.pending):
            if final or step < passed:
                self._write_step(step, self.pending.pop(step))

    def close(self) -> None:
        try:
            if self.metrics is not None and not self.failed:
                self.follow(self.metrics, final=True)
        except Exception as exc:
            log.warning("--tensorboard: the last steps were not written (%s: %s)", type(exc).__name__, exc)
        finally:
            self.writer.close()

    def _new_records(self, metrics: Path) -> list[dict[str, Any]]:
        try:
            with open(metrics, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line being written waits for the next call
        self.offset += len(complete)
        records = []
        for line in complete.decode("utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a damaged line: `felactl status` names it; TensorBoard shows the rest
            if isinstance(record, dict) and all(k in record for k in ("step", "rank", "time", "samples")):
                records.append(record)
        return records

    def _write_step(self, step: int, records: list[dict[str, Any]]) -> None:
        end = max(r["time"] for r in records)
        first = min(r.get("stage", 0) for r in records)
        counted = [r for r in records if r.get("stage", 0) == first]
        samples = sum(r["samples"] for r in counted)
        scalars: dict[str, float] = {}
        if (loss := step_losses(records).get(step)) is not None:  # as felactl status and report weigh it
            scalars["train/loss"] = loss
        if self.last_end is not None and end > self.last_end:
            scalars["train/samples_per_s"] = samples / (end - self.last_end)
        self.last_end = max(end, self.last_end or end)
        if (lr := next((r["lr"] for r in records if "lr" in r), None)) is not None:
            scalars["train/lr"] = lr
        for r in records:
            rank = f"worker/{r['rank']}"
            if r in counted and samples:
                scalars[f"{rank}/share"] = r["samples"] / samples
            scalars[f"{rank}/wait_s"] = r["wait_s"]
            scalars[f"{rank}/compute_s"] = r["compute_s"]
            for name, value in (r.get("eval") or {}).items():
                scalars[f"eval/{name}"] = value
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=end)
