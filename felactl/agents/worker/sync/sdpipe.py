"""SDPipe: a central scheduler decides groups; each group averages its weights among itself.

Only the small decision is central. The scheduler is a thread in rank 0 on its own store
connection: a worker that finished a local step appends ``rank`` to an arrival log in the store
(an atomic ``add`` gives its slot), then blocks on ``group/<rank>/<n>``; the scheduler reads the
log in order, runs :class:`GroupScheduler`, and writes each member its group. The heavy data never
passes the scheduler: the members average by point-to-point on a gloo group of their own. The
group's lowest rank gathers the others' parameters, averages, and sends the mean back (for the
default ``max_group = 2`` that is one exchange each way). Groups are disjoint at any moment and
tagged by their id, so any subset can average without ``new_group``, which would be collective
over all ranks. At the end every worker leaves and one global average makes the replicas equal.
"""

from __future__ import annotations

import json
import threading
import time

import torch
import torch.distributed as dist

from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.sync._local import local_steps
from felactl.agents.worker.sync.groups import GroupScheduler

LEAVE = -1
POLL_S = 0.0002
TAG_BASE = 1000


class SchedulerService:
    """Feeds the store's arrival log to a :class:`GroupScheduler` and publishes the groups."""

    def __init__(self, store: dist.Store, scheduler: GroupScheduler):
        self.store = store
        self.scheduler = scheduler
        self.error: BaseException | None = None
        self.sizes: list[int] = []
        self.thread = threading.Thread(target=self._run, name="sdpipe-scheduler", daemon=True)

    def _run(self) -> None:
        try:
            ticket, rounds = 1, {r: 0 for r in self.scheduler.members}
            while self.scheduler.active:
                key = f"sd/arrival/{ticket}"
                if self._arrived(key):
                    rank, kind = (int(x) for x in self.store.get(key).decode().split(":"))
                    ticket += 1
                    if kind == LEAVE:
                        self.scheduler.leave(rank)
                    else:
                        self.scheduler.arrive(rank, time.monotonic())
                for group in self.scheduler.poll(time.monotonic()):
                    self._publish(group, rounds)
        except BaseException as exc:
            self.error = exc

    def _arrived(self, key: str) -> bool:
        """Wait for the next arrival: blocking when no group can close on time (nobody waits, or a
        connection is due, which only arrivals can complete), polling until the deadline else."""
        if self.scheduler.deadline() is None:
            self.store.wait([key])
            return True
        if self.store.check([key]):
            return True
        time.sleep(POLL_S)
        return False

    def _publish(self, group: list[int], rounds: dict[int, int]) -> None:
        document = json.dumps({"id": self.scheduler.groups_formed, "members": sorted(group)})
        self.sizes.append(len(group))
        for rank in group:
            self.store.set(f"sd/group/{rank}/{rounds[rank]}", document)
            rounds[rank] += 1


def announce(store: dist.Store, rank: int, kind: int = 0) -> None:
    ticket = store.add("sd/tickets", 1)
    store.set(f"sd/arrival/{ticket}", f"{rank}:{kind}")


def average_in_group(trainer: Trainer, members: list[int], group_id: int, group) -> None:
    """Average the parameters of ``members`` (all call this) by p2p through the lowest rank."""
    if len(members) < 2:
        return
    flat = trainer.flat_params().cpu()
    leader, tag = members[0], TAG_BASE + group_id % 1_000_000
    if trainer.runtime.rank == leader:
        total, buffer = flat.clone(), torch.empty_like(flat)
        for peer in members[1:]:
            dist.recv(buffer, src=peer, group=group, tag=tag)
            total += buffer
        total /= len(members)
        works = [dist.isend(total, dst=peer, group=group, tag=tag) for peer in members[1:]]
        for work in works:
            work.wait()
        flat = total
    else:
        dist.send(flat, dst=leader, group=group, tag=tag)
        dist.recv(flat, src=leader, group=group, tag=tag)
    trainer.set_flat_params(flat.to(trainer.runtime.device))


def run(trainer: Trainer) -> None:
    runtime, sync_spec = trainer.runtime, trainer.plan.sync
    group = runtime.new_world_group(backend="gloo")
    service = None
    if runtime.rank == 0:
        scheduler = GroupScheduler(list(range(runtime.world_size)), sync_spec.max_group,
                                   sync_spec.initial_wait_ms / 1000, sync_spec.connect_every)
        service = SchedulerService(runtime.new_store_client(), scheduler)
        service.thread.start()
    store = runtime.store

    def sync(step: int) -> tuple[float, float]:
        start = time.perf_counter()
        announce(store, runtime.rank)
        document = json.loads(store.get(f"sd/group/{runtime.rank}/{step}").decode())
        waited = time.perf_counter()
        average_in_group(trainer, document["members"], document["id"], group)
        return time.perf_counter() - waited, waited - start

    local_steps(trainer, sync)
    announce(store, runtime.rank, LEAVE)
    if service is not None:
        service.thread.join()
        if service.error is not None:
            raise service.error
        runtime.store.set("sd/group_sizes", json.dumps(service.sizes))
    flat = trainer.flat_params()
    dist.all_reduce(flat, group=group if flat.device.type == "cpu" else None)
    trainer.set_flat_params(flat / runtime.world_size)
