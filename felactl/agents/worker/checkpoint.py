"""Checkpoints (atomic files). (A newcomer gets its state by broadcast, with no disk: replicate.py.)

A checkpoint holds the stage's parameters, the optimizer state, the step and the data position;
``step{K:06d}/stage{S}.pt`` is written by the first worker of each stage through
:func:`felactl.fsutil.atomic_write`, so a crash never leaves half a file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from felactl.fsutil import atomic_write


def checkpoint_path(run_dir: str | os.PathLike, step: int, stage: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step{step:06d}" / f"stage{stage}.pt"


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    data_position: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "data_position": data_position,
        **(extra or {}),
    }
    return atomic_write(path, lambda f: torch.save(state, f))


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state
