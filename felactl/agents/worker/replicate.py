"""IO-free replication (Elan): a worker that lacks the job's state gets it from live peers.

Every member of a freshly formed group calls :func:`replicate` with its step. The members at the
highest step hold the state (parameters, optimizer moments, step, data position, learning rate);
the others — newcomers, or survivors of a failure that had not finished the step the others did —
receive it, the LR scheduler's state (when the job has one) with it. The state is flattened into one buffer, cut into one disjoint shard per holder, and
every holder broadcasts its shard at the same time (asynchronous broadcasts, waited together),
so a newcomer's bytes come from several senders at once and never touch a file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class Replication:
    step: int
    data_position: int
    senders: dict[int, int] = field(default_factory=dict)
    """Group rank of each sender -> bytes of its shard (empty when nobody needed the state)."""
    received: bool = False
    seconds: float = 0.0


def _skeleton(optimizer: torch.optim.Optimizer) -> tuple[dict, list[tuple[int, str]]]:
    """The optimizer's state dict with every tensor replaced by its (shape, dtype), and the tensors' keys."""
    state = optimizer.state_dict()
    keys, skeleton = [], {"state": {}, "param_groups": state["param_groups"]}
    for index in sorted(state["state"]):
        entry = {}
        for name, value in sorted(state["state"][index].items()):
            if torch.is_tensor(value):
                entry[name] = ("tensor", tuple(value.shape), str(value.dtype).replace("torch.", ""))
                keys.append((index, name))
            else:
                entry[name] = value
        skeleton["state"][index] = entry
    return skeleton, keys


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters and buffers (a user's BatchNorm statistics are state too)."""
    return [p.detach() for p in model.parameters()] + [b.detach() for b in model.buffers()]


def _state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer, keys) -> list[torch.Tensor]:
    state = optimizer.state_dict()["state"]
    return _model_tensors(model) + [state[i][n] for i, n in keys]


def _allocate(skeleton: dict) -> dict:
    """A state dict shaped like ``skeleton`` with empty tensors where the tensors go."""
    state = {}
    for index, entry in skeleton["state"].items():
        state[index] = {
            name: (
                torch.empty(value[1], dtype=getattr(torch, value[2]))
                if isinstance(value, tuple) and value and value[0] == "tensor"
                else value
            )
            for name, value in entry.items()
        }
    return {"state": state, "param_groups": skeleton["param_groups"]}


def shard_bounds(total: int, num_shards: int) -> list[tuple[int, int]]:
    """``num_shards`` consecutive, disjoint [start, end) ranges covering ``0..total``."""
    size, extra = divmod(total, num_shards)
    bounds, start = [], 0
    for i in range(num_shards):
        end = start + size + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def replicate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    data_position: int,
    group=None,
    device: torch.device = torch.device("cpu"),
    scheduler=None,
) -> Replication:
    """Make every member hold the state of the members at the highest step; see the module doc."""
    start = time.perf_counter()
    world = dist.get_world_size(group)
    top, holders = _highest_step(step, world, group, device)
    if len(holders) == world:
        return Replication(step=step, data_position=data_position)
    me = dist.get_rank(group)
    holder = me in holders
    skeleton, keys, top, data_position, scheduler_state = _broadcast_layout(
        optimizer, scheduler, holder, holders[0], top, data_position, group
    )
    if holder:
        tensors = _state_tensors(model, optimizer, keys)
    else:
        loaded = _allocate(skeleton)
        tensors = _model_tensors(model) + [loaded["state"][i][n] for i, n in keys]
    flat = (
        torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
        if holder
        else torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32)
    )
    flat = flat.to(device)
    senders = _broadcast_shards(flat, holders, group)
    if not holder:
        _copy_from_flat(flat, tensors)
        optimizer.load_state_dict(loaded)
        if scheduler is not None and scheduler_state is not None:
            scheduler.load_state_dict(scheduler_state)
    return Replication(
        step=top,
        data_position=int(data_position),
        senders=senders,
        received=not holder,
        seconds=time.perf_counter() - start,
    )


def _highest_step(step: int, world: int, group, device: torch.device) -> tuple[int, list[int]]:
    """The highest step of the group's members, and the group ranks of the members at it (the holders)."""
    steps = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(steps, torch.tensor([step], dtype=torch.int64, device=device), group=group)
    steps_list = [int(s.item()) for s in steps]
    top = max(steps_list)
    holders = [r for r, s in enumerate(steps_list) if s == top]
    return top, holders


def _broadcast_layout(optimizer, scheduler, holder: bool, first_holder: int, top: int, data_position: int, group):
    """The first holder's optimizer skeleton, tensor keys, step, data position and LR-scheduler
    state, broadcast to every member: ``(skeleton, keys, top, data_position, scheduler_state)``."""
    skeleton, keys = _skeleton(optimizer) if holder else (None, None)
    scheduler_state = scheduler.state_dict() if holder and scheduler is not None else None
    meta = [skeleton, keys, top, data_position, scheduler_state]
    src0 = dist.get_global_rank(group, first_holder) if group is not None else first_holder
    dist.broadcast_object_list(meta, src=src0, group=group)
    return tuple(meta)


def _broadcast_shards(flat: torch.Tensor, holders: list[int], group) -> dict[int, int]:
    """Each holder broadcasts its shard of ``flat`` at once (asynchronously, waited together);
    returns the bytes each holder sent, by group rank."""
    bounds = shard_bounds(flat.numel(), len(holders))
    works, senders = [], {}
    for holder_rank, (a, b) in zip(holders, bounds):
        src = dist.get_global_rank(group, holder_rank) if group is not None else holder_rank
        works.append(dist.broadcast(flat[a:b], src=src, group=group, async_op=True))
        senders[holder_rank] = (b - a) * flat.element_size()
    for work in works:
        work.wait()
    return senders


def _copy_from_flat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Fill ``tensors`` in order from the one flat buffer they were sent in."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t).to(t.dtype))
            offset += n
