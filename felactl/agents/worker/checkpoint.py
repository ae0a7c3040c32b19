"""Checkpoints (atomic files). (A newcomer gets its state by broadcast, with no disk: replicate.py.)

A checkpoint holds the stage's parameters, the optimizer state, the step and the data position;
``step{K:06d}/stage{S}.pt`` is written by the first worker of each stage through
:func:`felactl.fsutil.atomic_write`, so a crash never leaves half a file. A sharded stage's
workers each write their own shards of its state, with ``torch.distributed.checkpoint``, to
``stage{S}.<id>.shards/`` (:func:`save_shards`; no worker gathers the whole stage, which a stage
sharded because no device holds it could not), and its file names that directory. A checkpoint the
storage cannot take (a read-only or full filesystem) is said (:func:`checkpoint_not_written`)
and the job goes on: a healthy job is not ended by its disk.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from felactl.control import EventKind
from felactl.control.events import record
from felactl.errors import InputError
from felactl.fsutil import STORAGE_ERRORS, atomic_write
from felactl.parallel.fsdp import SHARDS, check_shards, first_failure, is_sharded, stage_group, with_shards

log = logging.getLogger(__name__)


def checkpoint_path(run_dir: str | os.PathLike, step: int, stage: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step{step:06d}" / f"stage{stage}.pt"


def stage_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The stage's model and optimizer state as one process holding it whole would write them,
    both keyed by the user's names (the optimizer's as ``torch.distributed.checkpoint`` keys it),
    so a plan that cuts the model elsewhere can take them (:func:`restore_stage`). (A sharded
    stage's workers write theirs apart: :func:`save_shards`.)"""
    assert not is_sharded(model), "a sharded stage's state is its workers' shards: save_shards"
    names = optimizer_names(model, optimizer)
    state = optimizer.state_dict()
    return model.state_dict(), {
        "state": {names[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def save_shards(stage_file: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """Every worker of the sharded stage whose checkpoint is ``stage_file`` writes its shards of
    the stage's model and optimizer state (collective over the stage's workers) to a directory of
    this write's own beside it. Returns that directory's name on the stage's first worker (its
    group's rank 0), which writes the stage file naming it (:data:`SHARDS`), then drops the
    step's other directories of the stage (:func:`drop_other_shards`); None on the others.

    A stage file that exists names a complete directory: DCP writes the directory's ``.metadata``
    last and returns on every worker only after it. A restart that writes the same step again
    writes another directory and replaces the stage file in one rename, so no moment holds a
    stage file without its shards."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    group = stage_group(model)
    first = dist.get_rank(group) == 0
    name = [f"{stage_file.stem}.{uuid.uuid4().hex[:8]}.shards" if first else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    try:
        dcp.save(state, checkpoint_id=stage_file.with_name(name[0]), process_group=group)
    # a BaseException, which the worker's `except Exception` would miss; every worker of the stage
    # gets it where one's write failed
    except dcp.CheckpointException as exc:
        failures = [failure for failure, _trace in exc.failures.values()]
        if failures and all(isinstance(failure, STORAGE_ERRORS) for failure in failures):
            raise OSError(f"writing the stage's shards failed: {failures[0]}") from None
        raise RuntimeError(f"writing the stage's shards failed: {failures[0]!r}") from failures[0]
    return name[0] if first else None


def drop_other_shards(stage_file: Path, keep: str) -> None:
    """Remove the shard directories of ``stage_file``'s stage and step but ``keep`` (the one its
    stage file names): an earlier write's of the same step, or one a crash left unnamed."""
    for directory in stage_file.parent.glob(f"{stage_file.stem}.*.shards"):
        if directory.name != keep:
            shutil.rmtree(directory, ignore_errors=True)


def load_shards(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every worker of a sharded stage reads its shards of the state :func:`save_shards` wrote to
    ``directory`` (collective over the stage's workers; their number may differ from the writers':
    ``torch.distributed.checkpoint`` reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    try:
        check_shards(directory)
        dcp.load(state, checkpoint_id=directory, process_group=stage_group(model))
    except (OSError, dcp.CheckpointException) as exc:  # every worker of the stage gets it where one's read failed
        failure = first_failure(exc) if isinstance(exc, dcp.CheckpointException) else exc
        raise InputError(
            f"{directory}: the stage's shards are not readable ({type(failure).__name__}: {failure})"
        ) from None
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


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
    state: tuple[dict, dict] | None,
    step: int,
    data_position: int,
    layers: tuple[int, int],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``state`` (:func:`stage_state`; None for a sharded stage, whose ``extra`` names its
    shards) of the stage of ``layers`` (its first and past-last layer), the step and data
    position, atomically."""
    tensors = {}
    if state is not None:
        model_state, optimizer_state = state
        tensors = {"model": {k: v.cpu() for k, v in model_state.items()}, "optimizer": optimizer_state}
    state = {
        **tensors,
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
    state = _read(own) if own.exists() else None
    same = state is not None and tuple(state.get("layers", layers)) == tuple(layers)
    if same and SHARDS in state and is_sharded(model):
        load_shards(directory / state[SHARDS], model, optimizer)  # each worker its part, resharded
        return state
    needed = _needed_keys(model, optimizer, aliases)  # of a sharded stage's shards, the rest unread
    if same:
        state = with_shards(state, directory, needed)
    else:
        stages = [with_shards(_read(path), directory, needed) for path in sorted(directory.glob("stage*.pt"))]
        state = merged_stages(stages, directory)
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
    _load_whole(
        model, optimizer, model_state, _optimizer_part(state["optimizer"], model, optimizer, aliases, directory)
    )
    return state


def _load_whole(model: nn.Module, optimizer, model_state: dict, named: dict) -> None:
    """Load a stage's whole state (``model_state``, and the optimizer's by name: ``named``) into
    ``model`` and ``optimizer``; a sharded stage's workers each keep their shards of it."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(model, optimizer, named, options=options)
        return
    model.load_state_dict(model_state)
    names = optimizer_names(model, optimizer)
    index = {name: i for i, name in enumerate(names)}
    optimizer.load_state_dict(
        {
            "state": {index[name]: value for name, value in named["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]],
        }
    )


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


def _needed_keys(model: nn.Module, optimizer, aliases: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The DCP names of what ``model`` and ``optimizer`` take from a checkpoint: each weight's (by
    any of a tied weight's names), its optimizer state's, and the optimizer's groups."""
    names = {
        n for key in (*model.state_dict(), *optimizer_names(model, optimizer)) for n in (key, *aliases.get(key, ()))
    }
    return (
        *(f"model.{n}" for n in sorted(names)),
        *(f"optimizer.state.{n}" for n in sorted(names)),
        "optimizer.param_groups",
    )


def _read(path: Path) -> dict:
    """A stage file, memory-mapped: a tensor is read where it is used (a restart's stage takes
    its own layers of another plan's stage files), and the workers of a node share its pages."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
