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
from felactl.errors import InputError
from felactl.fsutil import atomic_write
from felactl.parallel.fsdp import is_sharded

log = logging.getLogger(__name__)


def checkpoint_path(run_dir: str | os.PathLike, step: int, stage: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step{step:06d}" / f"stage{stage}.pt"


def stage_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The stage's model and optimizer state as one process holding it whole would write them,
    both keyed by the user's names (the optimizer's as ``torch.distributed.checkpoint`` keys it),
    so a plan that cuts the model elsewhere can take them (:func:`restore_stage`). A sharded
    stage's is gathered from its workers through that state-dict API (collective: each of them
    calls it)."""
    if is_sharded(model):
        # Here, not at the top: it imports DTensor's ops and sympy (~1 s of every worker's start)
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)
    names = optimizer_names(model, optimizer)
    state = optimizer.state_dict()
    return model.state_dict(), {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter ``optimizer`` steps, in its order (a parameter two names
    share, a tied weight, goes by the first)."""
    name_of = {}
    for name, param in model.named_parameters():
        name_of.setdefault(id(param), name)
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def save_checkpoint(
    path: str | os.PathLike,
    *,
    state: tuple[dict, dict],
    step: int,
    data_position: int,
    layers: tuple[int, int],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``state`` (:func:`stage_state`) of the stage of ``layers`` (its first and past-last
    layer), the step and data position, atomically."""
    model_state, optimizer_state = state
    state = {
        "model": {k: v.cpu() for k, v in model_state.items()},
        "optimizer": optimizer_state,
        "layers": list(layers),
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


def restore_stage(
    directory: Path,
    stage: int,
    layers: tuple[int, int],
    model: nn.Module,
    optimizer,
    aliases: dict[str, tuple[str, ...]],
) -> dict:
    """Load the stage of ``layers`` from the checkpoint ``directory`` into ``model`` and
    ``optimizer``; returns the stage file it read (step, data position, the scheduler's state).

    Where the checkpoint's stage ``stage`` holds the same layers, its file alone; else (a plan
    that cuts the model elsewhere: a restart on other workers) every stage's files merged by the
    user's names, each tensor taken by its name or, for a weight the model ties, by another of
    its names (``aliases``). A sharded stage's workers each take their shards."""
    own = directory / f"stage{stage}.pt"
    state = _load(own) if own.exists() else None
    if state is None or tuple(state.get("layers", layers)) != tuple(layers):
        state = merged_stages([_load(path) for path in sorted(directory.glob("stage*.pt"))], directory)
    if any(isinstance(n, int) for g in state["optimizer"]["param_groups"] for n in g["params"]):
        # written before checkpoints named the optimizer's parameters: the same layout only
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return state
    model_state = {}
    for key in model.state_dict():
        found = _by_name(state["model"], key, aliases)
        if found is None:
            raise InputError(f"{directory}: no stage of the checkpoint holds {key!r}")
        model_state[key] = state["model"][found]
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(
            model, optimizer, _optimizer_part(state["optimizer"], model, optimizer, aliases, directory), options=options
        )
        return state
    model.load_state_dict(model_state)
    named = _optimizer_part(state["optimizer"], model, optimizer, aliases, directory)
    names = optimizer_names(model, optimizer)
    index = {name: i for i, name in enumerate(names)}
    optimizer.load_state_dict(
        {
            "state": {index[name]: value for name, value in named["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]],
        }
    )
    return state


def merged_stages(states: list[dict], directory: Path) -> dict:
    """Every stage file's model and optimizer state in one, by name (a weight two stages hold,
    tied, has equal copies: the first is kept); the optimizer's groups merged group by group
    (every stage's optimizer comes from the same factory). Step, position and the rest: the
    first stage's."""
    if not states:
        raise InputError(f"{directory}: no stage files to restore from")
    merged = dict(states[0])
    merged["model"] = {k: v for s in reversed(states) for k, v in s["model"].items()}
    merged["optimizer"] = {
        "state": {k: v for s in reversed(states) for k, v in s["optimizer"]["state"].items()},
        "param_groups": [
            {**group, "params": [n for s in states for n in s["optimizer"]["param_groups"][k]["params"]]}
            for k, group in enumerate(states[0]["optimizer"]["param_groups"])
        ],
    }
    return merged


def _optimizer_part(saved: dict, model: nn.Module, optimizer, aliases, directory: Path) -> dict:
    """The named optimizer state of the parameters ``optimizer`` steps, taken from ``saved``
    (every name the checkpoint's optimizers stepped): each group's hyperparameters as saved (the
    learning rate a scheduler set), its parameters this optimizer's."""
    known = {n for g in saved["param_groups"] for n in g["params"]}
    state, groups = {}, []
    names = iter(optimizer_names(model, optimizer))
    for k, group in enumerate(optimizer.param_groups):
        own = [next(names) for _ in group["params"]]
        for name in own:
            found = _by_name(known, name, aliases)
            if found is None:
                raise InputError(f"{directory}: the checkpoint's optimizers never held {name!r}")
            if found in saved["state"]:  # a parameter never stepped has no state
                state[name] = saved["state"][found]
        saved_group = saved["param_groups"][min(k, len(saved["param_groups"]) - 1)]
        groups.append({**{key: v for key, v in saved_group.items() if key != "params"}, "params": own})
    return {"state": state, "param_groups": groups}


def parameter_aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each name of a parameter the model holds under several (a tied weight): its other names."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return {n: tuple(m for m in group if m != n) for group in by_tensor.values() if len(group) > 1 for n in group}


def _by_name(saved, key: str, aliases: dict[str, tuple[str, ...]]) -> str | None:
    """The name ``saved`` holds ``key`` under: its own, or another name of the tied weight it is."""
    return next((name for name in (key, *aliases.get(key, ())) if name in saved), None)


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)
