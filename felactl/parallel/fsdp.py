"""torch FSDP2 (``fully_shard``) as felactl shards a stage: each of the model's blocks (its split
points, :mod:`felactl.models.split`) its own unit, so one block's weights are gathered at a time,
then the rest at the root; and the interface the worker's step runs a replica through (as it runs
DDP's)."""

from __future__ import annotations

import contextlib
import errno
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from felactl.errors import InputError

# FSDP and DTensor are imported where a stage is sharded, not with this module: they bring
# DTensor's ops and sympy, a second of every worker's start-up, for the few stages that shard.
# A module cannot be sharded, nor a tensor a DTensor, before they are imported (the tests below).


def shard(module: nn.Module, group, device: torch.device, units: Sequence[str] = ()) -> nn.Module:
    """``module`` sharded over ``group``, each submodule ``units`` names (module paths) a unit of
    its own (every rank of it calls this, with the same module): first
    its weights made the group's first rank's (felactl never re-initialises a user's model; it
    makes the replicas agree, as it does for replicated stages), then split."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    with torch.no_grad():
        for param in module.parameters():
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)
    mesh = DeviceMesh.from_group(group, device.type)
    for unit in units:
        fully_shard(module.get_submodule(unit), mesh=mesh)
    return fully_shard(module, mesh=mesh)


def sum_gradients(module: nn.Module) -> None:
    """Make ``module``'s sharded units reduce-scatter the sum of their workers' gradients, not the
    mean FSDP2 gives by default (a pipeline's stages weight each micro-batch's loss by the global
    batch themselves, as their replicated twins do before their sum-allreduce)."""
    for unit in module.modules():
        if is_sharded(unit):
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def is_sharded(module: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def is_dtensor(tensor: torch.Tensor) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this worker holds: its shard of a sharded parameter, else itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


class ShardedReplica:
    """A sharded stage, called as the step calls a DDP replica: ``no_sync()`` around the micro-
    batches before the last one (their gradients accumulate, reduce-scattered once, in the last
    backward), ``process_group`` the stage's group. FSDP2 averages the gradients it reduces over
    the group, as DDP does: the step multiplies the loss by the group's size, for the sum."""

    def __init__(self, module: nn.Module, group):
        self.module, self.process_group = module, group

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)


SHARDS = "shards"
"""The key under which a sharded stage's checkpoint file names the directory beside it that its
workers wrote their shards to, in ``torch.distributed.checkpoint``'s format (each worker its own
part: no worker gathers the stage)."""


def read_whole(directory, parts: tuple[str, ...] = ("model", "optimizer")) -> dict:
    """A sharded stage's checkpoint shards (``{"model": ..., "optimizer": ...}``, or those of
    ``parts``: an export reads no optimizer state, twice the weights under AdamW) read whole into
    this process, every tensor on the CPU, with no process group: what an export, or a plan that
    cuts the model elsewhere, needs. (DCP's own ``dcp_to_torch_save`` reads it this way; its
    planner is private, so ``tests/test_sharded_checkpoint.py`` pins it to the torch we run.)"""
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    check_shards(directory)
    state: dict = {}
    try:
        _load_state_dict(
            state,
            storage_reader=FileSystemReader(directory),
            planner=_EmptyStateDictLoadPlanner(keys=set(parts)),
            no_dist=True,
        )
    except CheckpointException as exc:  # a BaseException, which `except Exception` misses: its cause is one
        raise first_failure(exc) from None
    return state


def with_shards(state: dict, directory, parts: tuple[str, ...] = ("model", "optimizer")) -> dict:
    """A stage file's ``state`` (read from ``directory``) with ``parts`` of its model and optimizer
    state (:func:`read_whole`'s) read from the shards it names, where a sharded stage wrote it;
    InputError naming them where they cannot be read. The one reader of both the workers' restore
    and the launcher's export and resume."""
    if SHARDS not in state or not parts:
        return state
    shards = Path(directory) / state[SHARDS]
    try:
        return {**state, **read_whole(shards, parts)}
    except Exception as exc:  # DCP raises its own kinds on a missing or damaged shard
        raise InputError(f"{shards}: the stage's shards are not readable ({type(exc).__name__}: {exc})") from None


def check_shards(directory) -> None:
    """That a sharded stage's shards are all there: the ``.metadata`` DCP writes last, once every
    worker's shards are (without it DCP logs two tracebacks looking for another before failing),
    and every file it names, as long as the bytes read of it (DCP says only "failed reading zip
    archive"). OSError naming the file. A resume checks before it starts the workers, which would
    each build the model first."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = Path(directory) / ".metadata"
    if not metadata.is_file():
        raise FileNotFoundError(errno.ENOENT, "no .metadata: the shards were not all written", str(metadata))
    needs: dict[str, int] = {}
    for item in FileSystemReader(directory).read_metadata().storage_data.values():
        needs[item.relative_path] = max(needs.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needs.items()):
        path = Path(directory) / name
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, "a shard is missing", str(path))
        if path.stat().st_size < size:
            raise OSError(errno.EIO, f"a shard is cut short ({path.stat().st_size} of {size} bytes)", str(path))


def first_failure(exc) -> BaseException:
    """The first of the exceptions a ``torch.distributed.checkpoint.CheckpointException`` wraps
    (one per worker that failed)."""
    return next(iter(exc.failures.values()))[0]


def stage_group(module: nn.Module):
    """The process group a sharded ``module`` is sharded over (its parameters' mesh's)."""
    return next(module.parameters()).device_mesh.get_group()
