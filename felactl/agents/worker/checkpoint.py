"""Checkpoints (atomic files). (A newcomer gets its state by broadcast, with no disk: replicate.py.)

A checkpoint holds the stage's parameters, the optimizer state, the step and the data position;
``step{K:06d}/stage{S}.pt`` is written by the first worker of each stage through
:func:`felactl.fsutil.atomic_write`, so a crash never leaves half a file. A checkpoint the
storage cannot take (a read-only or full filesystem) is said (:func:`checkpoint_not_written`)
and the job goes on: a healthy job is not ended by its disk.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from felactl.control import EventKind
from felactl.control.events import record
from felactl.fsutil import atomic_write
from felactl.parallel.fsdp import is_sharded

log = logging.getLogger(__name__)


def checkpoint_path(run_dir: str | os.PathLike, step: int, stage: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step{step:06d}" / f"stage{stage}.pt"


def stage_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The stage's model and optimizer state as one process holding it whole would write them; a
    sharded stage's gathered from its workers through ``torch.distributed.checkpoint``'s state-dict
    API (collective: each of them calls it). The model's keys are the user's either way."""
    if is_sharded(model):
        # Here, not at the top: it imports DTensor's ops and sympy (~1 s of every worker's start)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)
    return model.state_dict(), optimizer.state_dict()


def save_checkpoint(
    path: str | os.PathLike,
    *,
    state: tuple[dict, dict],
    step: int,
    data_position: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``state`` (:func:`stage_state`), the step and data position, atomically."""
    model_state, optimizer_state = state
    state = {
        "model": {k: v.cpu() for k, v in model_state.items()},
        "optimizer": optimizer_state,
        "step": step,
        "data_position": data_position,
        **(extra or {}),
    }
    return atomic_write(path, lambda f: torch.save(state, f))


def checkpoint_not_written(events: Path, *, worker: int, step: int, path: Path, exc: Exception) -> None:
    """The checkpoint of ``step`` could not be written (``exc``, a storage error): a warning in
    this worker's log, and a ``checkpoint-failed`` event where events.jsonl can still be written."""
    log.warning(
        "worker %d: the checkpoint of step %d was not written (%s); training goes on, the next checkpoint will be tried",
        worker,
        step,
        exc,
    )
    record(events, EventKind.CHECKPOINT_FAILED, worker=worker, step=step, path=str(path), reason=str(exc))


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Load a stage's checkpoint into ``model`` and ``optimizer`` (a sharded stage's workers each
    take their shards of it)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, state["model"], options=options)
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
        return state
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state
