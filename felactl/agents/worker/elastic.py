"""Data-parallel training under live rescaling (Elan's three mechanisms, on the worker's side).

Membership generations. The coordinator (felactl.launcher.elastic) publishes generation ``G`` as a
document under ``<job prefix>elastic/gen/<G>`` (members' worker ids in rank order, the plan file)
and then bumps the key ``generation``. Each worker's heartbeat thread watches that key (every
100 ms, off the training thread), and each iteration folds the newest value it saw into the
one-element all-reduce that BSP already does before the last micro-batch (``MAX``), so all
members agree on the *same* boundary at no extra cost: after this step, switch.

Switching: staying workers destroy their process group and rendezvous a new one under
``<prefix>/gen<G>/`` (rank = position in the members list), rebind the trainer to the new plan
(shares, global batch, learning rate), rebuild DDP and call :func:`replicate`: whoever is behind
(a newcomer, which starts at step -1) receives the state in disjoint shards from every member
that holds it. A newcomer (``FELACTL_JOIN=1``) imports torch, builds the model and opens its
data *before* it says ``ready/<id>``; the coordinator only then publishes the generation that
includes it, so the pause the stayers see is the re-form and the broadcast, not a start-up.

The group's collectives time out after ``FELACTL_COLLECTIVE_TIMEOUT_S`` (short: the members
first meet on the store, without a timeout of that size, so start-up may be slow). A survivor
whose step failed says ``stuck/<G>/<id>``; when nobody is found dead, the coordinator re-forms
the same members (a collective that merely timed out costs a re-form, not the job).

Failures: a heartbeat thread sets ``hb/<id>`` every ``FELACTL_HEARTBEAT_S``; the coordinator
drops a member whose process ended or whose heartbeat stopped, killing it if it still exists,
which makes its peers' gloo collectives fail at once (connection closed) rather than after a
timeout. A survivor whose step failed discards that step's gradients, waits for the next
generation and re-forms; :func:`replicate` aligns anyone who missed a completed step.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import json
import logging
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from felactl.agents.worker.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from felactl.agents.worker.config import WorkerConfig
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.replicate import replicate
from felactl.agents.worker.runtime import Runtime, choose_device, connect_store
from felactl.agents.worker.sync.bsp import allreduce_grads, data_parallel, settle_buckets
from felactl.errors import InputError, WorkerFailed
from felactl.spec import SyncMode, load_plan

log = logging.getLogger(__name__)
POLL_S = 0.01


def elastic_prefix(store_prefix: str) -> str:
    """Where the elastic keys of a job live (the coordinator writes ``<job prefix>elastic/...``)."""
    return store_prefix + "elastic"


class Heartbeat(threading.Thread):
    """On its own store connection: sets ``hb/<id>`` (a growing counter and this worker's step)
    every ``FELACTL_HEARTBEAT_S``, and watches the ``generation`` key every ``WATCH_S``, so the
    training loop reads the newest generation from memory instead of asking the store each step."""

    WATCH_S = 0.1

    def __init__(self, cfg: WorkerConfig):
        super().__init__(name="felactl-heartbeat", daemon=True)
        raw = connect_store(cfg.store_host, cfg.store_port, is_master=False, timeout_s=cfg.timeout_s)
        self.kv = dist.PrefixStore(elastic_prefix(cfg.store_prefix), raw)
        self.key, self.interval_s = f"hb/{cfg.worker_id}", cfg.heartbeat_s
        self.step = -1
        self.generation = int(self.kv.get("generation"))
        self.stopped = threading.Event()
        self.cpu_s = 0.0
        """CPU seconds this thread has used: the steady-state cost of being elastic (the training
        loop's own generation check rides on BSP's arrival all-reduce, which it does anyway)."""

    def run(self) -> None:
        count, next_beat = 0, 0.0
        while not self.stopped.is_set():
            try:
                if time.monotonic() >= next_beat:
                    count += 1
                    self.kv.set(self.key, json.dumps({"n": count, "step": self.step, "pid": os.getpid()}))
                    next_beat = time.monotonic() + self.interval_s
                self.generation = int(self.kv.get("generation"))
            except RuntimeError:
                return  # the coordinator is gone; the main thread will notice too
            self.cpu_s = time.thread_time()
            self.stopped.wait(self.WATCH_S)


class ElasticWorker:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.wid = cfg.worker_id
        self.raw = connect_store(cfg.store_host, cfg.store_port, is_master=cfg.host_store, timeout_s=cfg.timeout_s)
        self.kv = dist.PrefixStore(elastic_prefix(cfg.store_prefix), self.raw)
        self.generation = int(self.kv.compare_set("generation", "", str(cfg.generation)))
        self.heartbeat = Heartbeat(cfg)
        self.members: list[int] = []
        self.trainer: Trainer | None = None
        self.ddp = None
        self.step, self.position = 0, 0
        self.form_s = 0.0

    # --- groups -------------------------------------------------------------------------------
    def form(self, rank: int, world_size: int, generation: int) -> Runtime:
        cfg = dataclasses.replace(self.cfg, rank=rank, world_size=world_size, generation=generation)
        store = dist.PrefixStore(f"{cfg.store_prefix}/gen{generation}", self.raw)
        backend, device = choose_device(cfg)
        self._arrive(generation, world_size)
        dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world_size,
                                timeout=_timedelta(cfg.collective_timeout_s))
        self.generation = generation
        return Runtime(cfg, store, backend, device, self.raw)

    def _arrive(self, generation: int, world_size: int) -> None:
        """Wait (up to the store timeout) until every member of ``generation`` is here, so the group
        itself can run with a short collective timeout even when a first start-up is slow."""
        key = f"arrived/{generation}"
        count = self.kv.add(key, 1)
        deadline = time.monotonic() + self.cfg.timeout_s
        while count < world_size:
            if time.monotonic() > deadline:
                raise WorkerFailed(f"worker {self.wid}: only {count} of {world_size} members of generation "
                                   f"{generation} arrived within {self.cfg.timeout_s:g} s")
            time.sleep(POLL_S)
            count = self.kv.add(key, 0)

    def _drop_group(self) -> None:
        self.ddp = None  # its reducer's hooks go with it, before a new DDP wraps the same module
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- start ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.heartbeat.start()
        if self.cfg.join:
            self._start_as_newcomer()
            return
        plan = self.cfg.load_plan()
        _check_plan(plan)
        self.members = list(range(self.cfg.world_size))
        runtime = self.form(self.cfg.rank, self.cfg.world_size, self.generation)
        self.trainer = Trainer(runtime, plan, metrics_rank=self.wid)
        if self.cfg.resume_from is not None:
            state = load_checkpoint(self.cfg.resume_from, self.trainer.model, self.trainer.optimizer)
            self.step, self.position = int(state["step"]), int(state["data_position"])
        self.ddp = data_parallel(self.trainer, dist.group.WORLD)

    def _start_as_newcomer(self) -> None:
        """Everything slow happens here, while the others train: import, build the model and its
        optimizer, open the data, run one warm-up forward and backward; then say ready and wait."""
        template = load_plan(self.cfg.plan_path)
        placeholder = Runtime(dataclasses.replace(self.cfg, rank=0, world_size=len(template.devices)),
                              self.kv, "gloo", torch.device("cpu"), self.raw)
        self.trainer = Trainer(placeholder, template, metrics_rank=self.wid)
        _warm_up(self.trainer)
        self.kv.set(f"ready/{self.wid}", json.dumps({"pid": os.getpid(), "time": time.time()}))
        doc = self._wait_generation(after=-1, timeout_s=self.cfg.timeout_s, must_include=True)
        members = [int(m) for m in doc["members"]]
        t = time.perf_counter()
        runtime = self.form(members.index(self.wid), len(members), int(doc["generation"]))
        self.form_s = time.perf_counter() - t
        plan = load_plan(doc["plan"])
        self.members = members
        self.trainer.rebind(runtime, plan)
        self.step = -1
        self._replicate_and_wrap(plan, doc, time.perf_counter(), stayed=False)

    # --- generations --------------------------------------------------------------------------
    def _doc(self, generation: int) -> dict:
        return json.loads(self.kv.get(f"gen/{generation}"))

    def _wait_generation(self, *, after: int, timeout_s: float, must_include: bool = False) -> dict:
        """The newest generation document past ``after`` (one that lists this worker, if asked)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            current = int(self.kv.get("generation"))
            if current > after and self.kv.check([f"gen/{current}"]):
                doc = self._doc(current)
                if not must_include or self.wid in doc["members"]:
                    return doc
            time.sleep(POLL_S)
        raise WorkerFailed(f"worker {self.wid}: no new membership generation within {timeout_s:g} s")

    def switch(self, doc: dict, last_step_end: float) -> bool:
        """Move to ``doc``'s generation; False when this worker is not in it (it leaves)."""
        self._drop_group()
        members = [int(m) for m in doc["members"]]
        generation = int(doc["generation"])
        if self.wid not in members:
            self.kv.set(f"left/{generation}/{self.wid}", json.dumps({"step": self.step}))
            return False
        t = time.perf_counter()
        runtime = self.form(members.index(self.wid), len(members), generation)
        self.form_s = time.perf_counter() - t
        plan = load_plan(doc["plan"])
        self.members = members
        self.trainer.rebind(runtime, plan)
        self._replicate_and_wrap(plan, doc, last_step_end, stayed=True)
        return True

    def _replicate_and_wrap(self, plan, doc: dict, last_step_end: float, *, stayed: bool) -> None:
        trainer = self.trainer
        rep = replicate(trainer.model, trainer.optimizer, step=self.step, data_position=self.position,
                        device=trainer.runtime.device)
        self.step, self.position = rep.step, rep.data_position
        for group in trainer.optimizer.param_groups:
            group["lr"] = plan.training.lr  # the hybrid-scaling policy's rate for this membership
        t = time.perf_counter()
        self.ddp = data_parallel(trainer, dist.group.WORLD, init_sync=False)
        wrap_s = time.perf_counter() - t
        pause_s = time.perf_counter() - last_step_end
        self.kv.set(f"switched/{doc['generation']}/{self.wid}", json.dumps(
            {"stayed": stayed, "pause_s": pause_s if stayed else None, "step": self.step,
             "received": rep.received, "replicate_s": rep.seconds, "form_s": self.form_s, "wrap_s": wrap_s,
             "senders": {str(self.members[r]): b for r, b in rep.senders.items()},
             "param_checksum": float(trainer.flat_params().double().sum())}))

    # --- training -----------------------------------------------------------------------------
    def one_step(self) -> int:
        """Train one iteration; return the newest generation any member had seen before it ended."""
        trainer, group = self.trainer, dist.group.WORLD
        start = time.perf_counter()
        seen = [float(self.heartbeat.generation)]

        def arrive() -> float:
            t = time.perf_counter()
            flag = torch.tensor([seen[0]], device=trainer.runtime.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            seen[0] = float(flag.item())
            return time.perf_counter() - t

        pattern_s = trainer.straggler.at_iteration(self.step)
        indices = [self.position + o for o in trainer.placement.offsets]
        if self.ddp is not None:
            result = trainer.compute(indices, weight_by=trainer.global_batch, ddp=self.ddp, before_last=arrive)
            wait_s, comm_s = result.waited_s, 0.0
        else:
            result = trainer.compute(indices, weight_by=trainer.global_batch)
            wait_s = arrive()
            comm_s = allreduce_grads(trainer, group) if len(self.members) > 1 else 0.0
        trainer.optimizer_step()
        settle_buckets(self.ddp)
        trainer.record(step=self.step, samples=result.samples, loss_sum=result.loss_sum,
                       compute_s=result.compute_s + pattern_s, comm_s=comm_s, wait_s=wait_s,
                       duration_s=time.perf_counter() - start, generation=self.generation, pid=os.getpid())
        self.step += 1
        self.position += trainer.global_batch
        self.heartbeat.step = self.step
        self._maybe_checkpoint()
        return int(seen[0])

    def _maybe_checkpoint(self) -> None:
        every = self.cfg.checkpoint_every
        if every and self.step % every == 0 and self.trainer.runtime.rank == 0:
            t = self.trainer
            save_checkpoint(checkpoint_path(self.cfg.run_dir, self.step, 0), model=t.model, optimizer=t.optimizer,
                            step=self.step, data_position=self.position,
                            extra={"global_batch": t.global_batch, "members": self.members,
                                   "generation": self.generation})

    def train(self) -> bool:
        """Until the last step; False when this worker was removed on the way."""
        last_step_end = time.perf_counter()
        while self.step < self.cfg.steps:
            failed = None
            try:
                agreed = self.one_step()
            except RuntimeError as exc:  # a peer died or hung: this step did not complete here
                failed = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if failed is not None:
                self._recover(failed)
                doc = self._wait_generation(after=self.generation, timeout_s=self.cfg.timeout_s)
                if not self.switch(doc, last_step_end):
                    return False
                continue
            last_step_end = time.perf_counter()
            if agreed > self.generation and not self.switch(self._doc(agreed), last_step_end):
                return False
        return True

    def _recover(self, why: str) -> None:
        """Drop the step's gradients and this group at once (outside the ``except``, so the
        traceback no longer holds DDP): closing our connections fails the collectives that other
        survivors are still blocked in, instead of leaving them to the collective timeout."""
        log.warning("worker %d: step %d failed (%s); waiting for the next generation", self.wid, self.step, why)
        self.trainer.optimizer.zero_grad(set_to_none=True)
        _sever_peer_connections(self.cfg.store_port)
        self._drop_group()
        gc.collect()
        self.kv.set(f"stuck/{self.generation}/{self.wid}", why)

    def close(self) -> None:
        self.heartbeat.stopped.set()
        self._drop_group()


def _sever_peer_connections(store_port: int) -> None:
    """Shut down this process's TCP connections to its peers (all but the store's): a survivor
    blocked in a collective waiting on *this* worker then fails at once instead of after the
    collective timeout. Destroying the group alone does not do it while gloo still holds the
    pairs of the failed operation."""
    import psutil
    import socket as socketlib

    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or not conn.raddr or conn.raddr.port == store_port:
            continue
        if conn.laddr and conn.laddr.port == store_port:
            continue
        try:
            sock = socketlib.socket(fileno=os.dup(conn.fd))
            try:
                sock.shutdown(socketlib.SHUT_RDWR)
            finally:
                sock.close()
        except OSError:
            pass


def _warm_up(trainer: Trainer) -> None:
    """One forward and backward on a micro-batch, gradients dropped: first-call costs are paid now."""
    inputs, targets = trainer.batch(range(min(trainer.micro_batch, trainer.global_batch)))
    trainer.bundle.loss(trainer.model(inputs), targets).backward()
    trainer.optimizer.zero_grad(set_to_none=True)


def _check_plan(plan) -> None:
    if len(plan.stages) != 1 or plan.sync.mode is not SyncMode.BSP:
        raise InputError("elastic training runs data-parallel plans (one stage) with sync bsp; "
                         f"this plan has {len(plan.stages)} stage(s) and sync {plan.sync.mode.value}")


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def run_elastic(cfg: WorkerConfig) -> dict:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: where is a stuck worker?
    worker = ElasticWorker(cfg)
    try:
        worker.start()
        start = time.perf_counter()
        finished = worker.train()
        wall_s = time.perf_counter() - start
        if finished:
            worker.trainer.totals["heartbeat_cpu_s"] = round(worker.heartbeat.cpu_s, 6)
            worker.trainer.finish(wall_s)
            dist.barrier()
            worker.kv.set(f"done/{worker.wid}", json.dumps({"step": worker.step}))
        return dict(worker.trainer.totals, wall_s=wall_s, left=not finished)
    finally:
        worker.close()
