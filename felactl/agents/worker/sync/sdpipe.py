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
from felactl.agents.worker.strategy import AtOwnPace, StepResult, Work
from felactl.agents.worker.sync.groups import GroupScheduler
from felactl.control import keys

LEAVE = -1
POLL_S = 0.0002
TAG_BASE = 1000


class SchedulerService:
    """Feeds one stage's arrival log (keys under ``prefix``) to a :class:`GroupScheduler` and
    publishes the groups."""

    def __init__(self, store: dist.Store, scheduler: GroupScheduler, prefix: str):
        self.store = store
        self.scheduler = scheduler
        self.prefix = prefix
        self.error: BaseException | None = None
        self.sizes: list[int] = []
        self.thread = threading.Thread(target=self._run, name="sdpipe-scheduler", daemon=True)

    def _run(self) -> None:
        try:
            ticket, rounds = 1, {r: 0 for r in self.scheduler.members}
            while self.scheduler.active:
                key = self.prefix + keys.sdpipe_arrival(ticket)
                if self._arrived(key):
                    rank, kind = (int(x) for x in self.store.get(key).decode().split(":"))
                    self.store.delete_key(key)
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
        """Wait for the next arrival: blocking when no group can close on time (nobody waits, or
        workers are held for a connection, which only arrivals and leaves complete), polling until
        the deadline else."""
        if self.scheduler.deadline() is None:
            self.store.wait([key])
            return True
        if self.store.check([key]):
            return True
        time.sleep(POLL_S)
        return False

    def _publish(self, group: list[int], rounds: dict[int, int]) -> None:
        held = sorted(set(group) & set(self.scheduler.held))
        document = json.dumps({"id": self.scheduler.groups_formed, "members": sorted(group), "again": held})
        self.sizes.append(len(group))
        for rank in group:
            self.store.set(self.prefix + keys.sdpipe_group(rank, rounds[rank]), document)
            rounds[rank] += 1


def announce(store: dist.Store, prefix: str, rank: int, kind: int = 0) -> None:
    ticket = store.add(prefix + keys.SDPIPE_TICKETS, 1)
    store.set(prefix + keys.sdpipe_arrival(ticket), f"{rank}:{kind}")


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


class SDPipeSync:
    """One worker's SDPipe: its stage's scheduler (hosted by rank 0, one per stage), the p2p group
    for averaging, and the final average that leaves the stage's replicas identical."""

    def __init__(self, trainer: Trainer, stage_rank_sets: list[tuple[int, ...]]):
        self.trainer = trainer
        runtime, spec = trainer.runtime, trainer.plan.sync
        self.prefix = keys.sdpipe_stage(trainer.placement.stage)
        self.group = runtime.new_world_group(backend="gloo")
        self.rounds = 0  # the groups this worker was given: the key of its next
        self.services = []
        if runtime.rank == 0:
            for stage, ranks in enumerate(stage_rank_sets):
                scheduler = GroupScheduler(list(ranks), spec.max_group, spec.initial_wait_ms / 1000, spec.connect_every)
                self.services.append(SchedulerService(runtime.new_store_client(), scheduler, keys.sdpipe_stage(stage)))
            for service in self.services:
                service.thread.start()

    def sync(self) -> tuple[float, float]:
        """After a local step: report ready, get a group, average in it (again, while the scheduler
        holds this worker for a connection). Returns (comm_s, wait_s)."""
        store, rank = self.trainer.runtime.store, self.trainer.runtime.rank
        comm_s, wait_s = 0.0, 0.0
        announce(store, self.prefix, rank)
        while True:
            start = time.perf_counter()
            key = self.prefix + keys.sdpipe_group(rank, self.rounds)
            self.rounds += 1
            self.trainer.wait_for_key(store, key)  # the scheduler's worker may have died
            document = json.loads(store.get(key).decode())
            store.delete_key(key)
            waited = time.perf_counter()
            average_in_group(self.trainer, document["members"], document["id"], self.group)
            comm_s, wait_s = comm_s + time.perf_counter() - waited, wait_s + waited - start
            if rank not in document["again"]:
                return comm_s, wait_s

    def finish(self) -> None:
        runtime = self.trainer.runtime
        announce(runtime.store, self.prefix, runtime.rank, LEAVE)
        for stage, service in enumerate(self.services):
            self.trainer.join_thread(service.thread, f"stage {stage}'s SDPipe scheduler did not see every worker leave")
            if service.error is not None:
                raise service.error
            sizes = {str(n): service.sizes.count(n) for n in sorted(set(service.sizes))}
            self.trainer.totals.setdefault("sdpipe_group_sizes", {})[f"stage{stage}"] = sizes
        ranks = self.trainer.placement.stage_ranks
        flat = self.trainer.flat_params()
        if len(ranks) > 1:
            dist.all_reduce(flat, group=runtime.group(ranks))
        self.trainer.set_flat_params(flat / len(ranks))


class SDPipe(AtOwnPace):
    """Data-parallel SDPipe: after each local step a worker averages with the group its stage's
    scheduler formed of the workers ready then."""

    def __init__(self, trainer: Trainer):
        super().__init__(trainer)
        self.sdpipe = SDPipeSync(trainer, [trainer.placement.stage_ranks])

    def step(self, work: Work) -> StepResult:
        result = self.trainer.compute(work.indices)
        self.trainer.optimizer_step(at_step=work.step)
        return self.trained_then_synced(result, self.sdpipe.sync)

    def finish(self) -> None:
        self.sdpipe.finish()
        super().finish()
