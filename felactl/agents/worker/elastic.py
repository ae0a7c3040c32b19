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
timeout. A survivor whose step failed discards that step's gradients, says which members it
could not reach (:mod:`felactl.agents.worker.reach`: a partition leaves everyone alive), waits
for the next generation and re-forms; :func:`replicate` aligns anyone who missed a completed step.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import gc
import logging
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from felactl.agents.worker.config import WorkerConfig
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.loop import Membership, adopt_claimed_position, claimed_position, train
from felactl.agents.worker.main import load_checked
from felactl.agents.worker.reach import ProbeListener, local_address, unreachable
from felactl.agents.worker.replicate import replicate
from felactl.agents.worker.runtime import Runtime, choose_device, connect_store
from felactl.agents.worker.strategies import strategy_for
from felactl.control import keys
from felactl.control.documents import (
    ArrivedDoc,
    DoneDoc,
    GenerationDoc,
    HeartbeatDoc,
    LeftDoc,
    ReadyDoc,
    StuckDoc,
    SwitchAtDoc,
    SwitchedDoc,
)
from felactl.control.seal import parse_int
from felactl.errors import InputError, WorkerFailed
from felactl.spec import Plan, load_plan
from felactl.spec.executable import RESCALABLE_SYNC, rescalable

log = logging.getLogger(__name__)
POLL_S = 0.01
PLANNED = ("scale-out", "scale-in")
"""The kinds of generation the coordinator forms on request (the others re-form after a failure)."""
ARRIVAL_REPEAT_S = 0.1


def elastic_prefix(store_prefix: str) -> str:
    """Where the elastic keys of a job live (the coordinator writes ``<job prefix>elastic/...``)."""
    return store_prefix + keys.ELASTIC.rstrip("/")


class Heartbeat(threading.Thread):
    """On its own store connection: sets ``hb/<id>`` (a growing counter and this worker's step)
    every ``FELACTL_HEARTBEAT_S``, and watches the ``generation`` key every ``WATCH_S``, so the
    training loop reads the newest generation from memory instead of asking the store each step."""

    WATCH_S = 0.1

    def __init__(self, cfg: WorkerConfig):
        super().__init__(name="felactl-heartbeat", daemon=True)
        raw = connect_store(cfg.store_host, cfg.store_port, is_master=False, timeout_s=cfg.timeout_s)
        self.reader = cfg.reader(raw)
        self.key, self.interval_s = keys.heartbeat(cfg.worker_id), cfg.heartbeat_s
        self.step = -1
        """This worker's steps done, said in each beat; -1 until it has started (:meth:`ElasticWorker.start`)."""
        self.generation = cfg.generation
        self.docs: dict[int, dict] = {}
        """Generation -> its verified document (what the training thread switches to)."""
        self.watch()
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
                    self.reader.write(
                        self.key,
                        HeartbeatDoc.KIND.value,
                        HeartbeatDoc(n=count, step=self.step, pid=os.getpid()).to_body(),
                        generation=self.generation,
                    )
                    next_beat = time.monotonic() + self.interval_s
                self.watch()
            except RuntimeError:
                return  # the coordinator is gone; the main thread will notice too
            self.cpu_s = time.thread_time()
            self.stopped.wait(self.WATCH_S)

    def watch(self) -> None:
        """Take the ``generation`` hint when a valid signed document backs it; a number without one
        (a deleted, bumped or forged key) is ignored: the coordinator writes the true one back."""
        hint = parse_int(self.reader.raw(keys.GENERATION))
        if hint is not None and hint > self.generation:
            doc = self.docs.get(hint) or read_generation(self.reader, hint)
            if doc is not None:
                self.docs[hint] = doc
                self.generation = hint


def read_generation(reader, generation: int) -> dict | None:
    """The verified document of ``generation`` (its body), or None: absent, or a forgery (recorded)."""
    doc = reader.read_doc(keys.generation_document(generation), GenerationDoc, generation=generation)
    return doc.to_body() if doc is not None and doc.generation == generation else None


class ElasticWorker(Membership):
    """One worker of an elastic job: the membership hooks of the training loop (generations,
    switching, failures) and its start as an original member or a newcomer."""

    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.wid = cfg.worker_id
        self.raw = connect_store(cfg.store_host, cfg.store_port, is_master=cfg.host_store, timeout_s=cfg.timeout_s)
        self.kv = dist.PrefixStore(elastic_prefix(cfg.store_prefix), self.raw)
        self.reader = cfg.reader(self.raw)
        self.generation = cfg.generation
        self.heartbeat = Heartbeat(cfg)
        self.probe = ProbeListener(local_address(cfg.store_host, cfg.store_port))
        """Where the other members test that they reach this one (after a failed step)."""
        self.members: list[int] = []
        self.trainer: Trainer | None = None
        self.strategy = None
        self.agreed_generation = self.generation
        self.switch_plan: dict | None = None
        """Where and to which generation the members agreed to switch, when not at BSP's arrival."""
        self.last_step_end = time.perf_counter()
        self.form_s = 0.0
        self.collective_timeout_due = False
        """Whether the group still runs under the start-up timeout (see :meth:`form`)."""
        self.unsettled_store: dist.Store | None = None
        """After a failure in a mode at its own pace: the old generation's store, whose data
        counter says how far the members got (see :meth:`_merge_unsettled`)."""

    @property
    def step(self) -> int:
        return self.trainer.steps_done

    # --- groups -------------------------------------------------------------------------------
    def form(self, rank: int, world_size: int, generation: int) -> Runtime:
        cfg = dataclasses.replace(self.cfg, rank=rank, world_size=world_size, generation=generation)
        store = dist.PrefixStore(keys.generation_namespace(cfg.store_prefix, generation), self.raw)
        backend, device = choose_device(cfg)
        if backend == "nccl":
            _nccl_errors_reach_the_caller()
        self._arrive(generation, rank, world_size)
        # A new group runs its first step under the start-up timeout: until every member has done
        # one, a member may still be building its optimizer or running a first forward that
        # compiles or autotunes, and a short collective timeout would fail a healthy job there,
        # before the loop that survives failures has begun. after_step then shortens it.
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", store),
            rank=rank,
            world_size=world_size,
            timeout=_timedelta(max(cfg.timeout_s, cfg.collective_timeout_s)),
        )
        self.collective_timeout_due = True
        self.generation = generation
        return Runtime(cfg, store, backend, device, self.raw)

    def _arrive(self, generation: int, rank: int, world_size: int) -> None:
        """Wait (up to the store timeout) until every member of ``generation`` is here, so the group
        itself can run with a short collective timeout even when a first start-up is slow. Each
        member says so in a signed document of its own, again while it waits (a counter anyone could
        move; a deleted document comes back). Raises :class:`Superseded` when a newer generation is
        published while some are missing: a member failed before it came (a node that could not
        start), and the coordinator formed the job without it."""
        deadline = time.monotonic() + self.cfg.timeout_s
        said = 0.0
        while True:
            if time.monotonic() - said > ARRIVAL_REPEAT_S:
                self.reader.write(
                    keys.arrived(generation, rank),
                    ArrivedDoc.KIND.value,
                    ArrivedDoc(worker_id=self.wid, probe=self.probe.address).to_body(),
                    generation=generation,
                )
                said = time.monotonic()
            missing = [
                r
                for r in range(world_size)
                if self.reader.read(keys.arrived(generation, r), ArrivedDoc.KIND.value, generation=generation) is None
            ]
            if not missing:
                return
            if self.heartbeat.generation > generation:
                raise Superseded(self.heartbeat.generation)
            if time.monotonic() > deadline:
                raise WorkerFailed(
                    f"worker {self.wid}: only {world_size - len(missing)} of {world_size} members of "
                    f"generation {generation} arrived within {self.cfg.timeout_s:g} s (no valid "
                    f"{keys.arrived(generation, missing[0])})"
                )
            time.sleep(POLL_S)

    def _drop_group(self, *, failed: bool = False) -> None:
        self.strategy = None  # DDP's reducer hooks go with it, before a new DDP wraps the same module
        if not dist.is_initialized():
            return
        if failed and dist.get_backend() == "nccl":
            # A failed step's collective may still be on the GPU, waiting for a peer that is gone:
            # destroying the group would wait for it too; aborting the communicators ends it.
            try:
                dist.distributed_c10d._abort_process_group()
                return
            except (RuntimeError, ValueError) as exc:  # an experimental API of torch's: fall back
                log.warning("worker %d: aborting the NCCL group failed (%s); destroying it", self.wid, exc)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _form_newest(self, doc: dict) -> tuple[dict, Runtime | None]:
        """Form the group of ``doc``'s generation, or of the newest one should others come while
        its members gather; with that generation's document. None: this worker is not in it."""
        while True:
            members = [int(m) for m in doc["members"]]
            if self.wid not in members:
                return doc, None
            t = time.perf_counter()
            try:
                runtime = self.form(members.index(self.wid), len(members), int(doc["generation"]))
            except Superseded as newer:
                doc = self._doc(newer.generation)
                continue
            self.form_s = time.perf_counter() - t
            self.members = members
            return doc, runtime

    # --- start ----------------------------------------------------------------------------------
    def start(self):
        """Join the job (an original member, or a newcomer) and return the strategy to train with.
        The model, its optimizer and a resume's state are ready before the members gather, so
        what fails in the user's code fails before any peer waits on this worker."""
        self.heartbeat.start()
        if self.cfg.join:
            strategy = self._start_as_newcomer()
        else:
            strategy = self._start_as_member()
        self.heartbeat.step = self.step  # said in the next beat: this worker has started
        return strategy

    def _start_as_member(self):
        plan, bundle = load_checked(self.cfg)
        _check_plan(plan)
        self.trainer = Trainer(self._placeholder_runtime(plan), plan, bundle, metrics_rank=self.wid)
        self.trainer.restore()
        launch = {"generation": self.generation, "members": list(range(self.cfg.world_size)), "kind": "launch"}
        doc, runtime = self._form_newest(launch)
        if runtime is None:
            raise WorkerFailed(
                f"worker {self.wid}: the job went on without this worker (generation {doc['generation']})"
            )
        if doc is not launch:  # a node could not start: the others start in the generation without it
            plan = load_plan(doc["plan"])
        self.trainer.rebind(runtime, plan)
        self.trainer.sync_replicas()
        if doc is not launch:
            return self._replicate_and_wrap(plan, doc, self.last_step_end, stayed=True)
        self._join_loop()
        self.strategy = strategy_for(plan)(self.trainer)
        return self.strategy

    def _placeholder_runtime(self, plan: Plan) -> Runtime:
        """Where the trainer is built for ``plan`` before its group exists: on its device, at this
        worker's rank in the plan (a newcomer's, which learns its own later: 0)."""
        cfg = self.cfg if not self.cfg.join else dataclasses.replace(self.cfg, rank=0, world_size=len(plan.devices))
        backend, device = choose_device(cfg)
        return Runtime(cfg, self.kv, backend, device, self.raw)

    def _join_loop(self) -> None:
        self.trainer.agreement = self
        self.trainer.interrupted = self.members_changed_under_a_wait
        self.trainer.checkpoint_extra = self.membership()
        self.kinds: dict[int, str] = {}

    def members_changed_under_a_wait(self) -> bool:
        """Whether the coordinator re-forms the job because a member failed (or a step was stuck):
        a wait on the others then never ends. (A planned scale-out or -in is made at a step the
        members agree on; every wait before it ends by itself.)"""
        newest = self.heartbeat.generation
        return newest > self.generation and not self._planned(newest)

    def _planned(self, generation: int) -> bool:
        """Whether ``generation`` is a planned scale-out or -in (not a re-form after a failure)."""
        if generation not in self.kinds:  # a scale-out may be followed by a failure: each has its kind
            self.kinds[generation] = self._doc(generation).get("kind", "failure")
        return self.kinds[generation] in PLANNED

    def _start_as_newcomer(self):
        """Everything slow happens here, while the others train: import, build the model and its
        optimizer, open the data, run one warm-up forward and backward; then say ready and wait."""
        template = load_plan(self.cfg.plan_path)
        self.trainer = Trainer(self._placeholder_runtime(template), template, metrics_rank=self.wid)
        _warm_up(self.trainer)
        self.reader.write(
            keys.ready(self.wid), ReadyDoc.KIND.value, ReadyDoc(pid=os.getpid(), time=time.time()).to_body()
        )
        doc, runtime = None, None
        while runtime is None:  # a generation that lists it, formed (a newer one may come while it gathers)
            after = -1 if doc is None else int(doc["generation"])
            doc = self._wait_generation(after=after, timeout_s=self.cfg.timeout_s, must_include=True)
            doc, runtime = self._form_newest(doc)
        plan = load_plan(doc["plan"])
        self.trainer.rebind(runtime, plan)
        self.trainer.steps_done = -1  # behind everyone: replication hands it the state
        return self._replicate_and_wrap(plan, doc, time.perf_counter(), stayed=False)

    # --- generations --------------------------------------------------------------------------
    def _doc(self, generation: int) -> dict:
        """The verified document of ``generation``, waiting for it a store timeout at most (a
        member may have seen it before a forgery replaced it: the coordinator writes it back)."""
        deadline = time.monotonic() + self.cfg.timeout_s
        while (doc := self.heartbeat.docs.get(generation) or read_generation(self.reader, generation)) is None:
            if time.monotonic() > deadline:
                raise WorkerFailed(
                    f"worker {self.wid}: no valid signed document at "
                    f"{keys.generation_document(generation)} within {self.cfg.timeout_s:g} s"
                )
            time.sleep(POLL_S)
        return doc

    def _wait_generation(self, *, after: int, timeout_s: float, must_include: bool = False) -> dict:
        """The newest generation document past ``after`` (one that lists this worker, if asked)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            current = parse_int(self.reader.raw(keys.GENERATION))
            if current is not None and current > after:
                doc = self.heartbeat.docs.get(current) or read_generation(self.reader, current)
                if doc is not None and (not must_include or self.wid in doc["members"]):
                    return doc
            time.sleep(POLL_S)
        raise WorkerFailed(f"worker {self.wid}: no new membership generation within {timeout_s:g} s")

    def switch(self, doc: dict):
        """Move to ``doc``'s generation (or a newer one, should a member fail to come); None when
        this worker is not in it (it leaves)."""
        self._drop_group()
        doc, runtime = self._form_newest(doc)
        if runtime is None:
            generation = int(doc["generation"])
            self.reader.write(
                keys.left(generation, self.wid), LeftDoc.KIND.value, LeftDoc(self.step).to_body(), generation=generation
            )
            return None
        plan = load_plan(doc["plan"])
        self.trainer.rebind(runtime, plan)
        return self._replicate_and_wrap(plan, doc, self.last_step_end, stayed=True)

    def _replicate_and_wrap(self, plan, doc: dict, last_step_end: float, *, stayed: bool):
        trainer = self.trainer
        if strategy_for(plan).settles_anywhere and doc.get("kind") not in PLANNED:
            self._merge_unsettled()
        rep = replicate(
            trainer.model,
            trainer.optimizer,
            step=trainer.steps_done,
            data_position=trainer.data_position,
            device=trainer.runtime.device,
            scheduler=trainer.scheduler,
        )
        # the run goes on from the state every member now holds, in this generation's batches
        trainer.steps_done = trainer.start_step = rep.step
        trainer.data_position = trainer.start_position = rep.data_position
        self.agreed_generation, self.switch_plan = self.generation, None
        self._join_loop()
        trainer.apply_plan_lr(plan)  # the hybrid-scaling policy's rate for this membership
        t = time.perf_counter()
        self.strategy = strategy_for(plan)(trainer)
        wrap_s = time.perf_counter() - t
        pause_s = time.perf_counter() - last_step_end
        self.reader.write(
            keys.switched(doc["generation"], self.wid),
            SwitchedDoc.KIND.value,
            SwitchedDoc(
                {
                    "stayed": stayed,
                    "pause_s": pause_s if stayed else None,
                    "step": self.step,
                    "received": rep.received,
                    "replicate_s": rep.seconds,
                    "form_s": self.form_s,
                    "wrap_s": wrap_s,
                    "senders": {str(self.members[r]): b for r, b in rep.senders.items()},
                    "param_checksum": float(trainer.flat_params().double().sum()),
                }
            ).to_body(),
            generation=doc["generation"],
        )
        return self.strategy

    # --- the loop's hooks ---------------------------------------------------------------------
    def proposals(self) -> list[float]:
        """What this member proposes at each step's arrival: the newest generation it has seen."""
        return [float(self.heartbeat.generation)]

    def agreed(self, values: list[float]) -> None:
        self.agreed_generation = int(values[0])

    def record_extra(self) -> dict:
        return {"generation": self.generation, "pid": os.getpid()}

    def after_step(self) -> dict | None:
        """Switch after the step every member agreed on, to the generation they agreed on."""
        self.last_step_end = time.perf_counter()
        self.heartbeat.step = self.step
        if self.collective_timeout_due:  # every member has been through a step of this group
            dist.distributed_c10d._set_pg_timeout(_timedelta(self.cfg.collective_timeout_s))
            self.collective_timeout_due = False
        if self.strategy.agrees_at_arrival:  # the newest generation any member saw, at this step's arrival
            return self._doc(self.agreed_generation) if self.agreed_generation > self.generation else None
        if self.strategy.settles_anywhere:
            return self._settle_for_newer_generation()
        if self.switch_plan is None and self.heartbeat.generation > self.generation:
            # The first member to see a new generation proposes to switch a few steps ahead (more
            # than any member runs ahead of another); the store keeps the first proposal for all.
            proposal = SwitchAtDoc(at=self.step + self.trainer.drain.margin, to=self.heartbeat.generation)
            self.switch_plan = self.reader.agree(
                keys.switch_agreement(self.generation),
                SwitchAtDoc.KIND.value,
                proposal.to_body(),
                generation=self.generation,
            )
        if self.switch_plan is not None and self.step >= self.switch_plan["at"]:
            return self._doc(int(self.switch_plan["to"]))
        return None

    def _settle_for_newer_generation(self) -> dict | None:
        """Modes at their own pace (WBSP, SDPipe) need no common step to switch at: a member that
        sees a planned generation settles with the others (:meth:`Strategy.finish`: every
        member's progress merged, the replicas identical, the data position agreed) wherever
        each stands, and then they switch to the newest generation any of them saw."""
        newest = self.heartbeat.generation
        if newest <= self.generation:
            return None
        if not self._planned(newest):  # a member died: the settle would wait on it
            raise RuntimeError(f"worker {self.wid}: generation {newest} re-forms the job after a failure")
        self.strategy.finish()
        agreed = torch.tensor([newest], dtype=torch.int64, device=self.trainer.runtime.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return self._doc(int(agreed.item()))

    survives_failures = True

    def after_failure(self, why: str) -> dict:
        """A peer died or hung: wait for the generation the coordinator forms without it."""
        if self.strategy is not None and self.strategy.settles_anywhere:
            # The members stopped each at a step of its own, unsettled: the next group merges them.
            self.unsettled_store = self.trainer.runtime.store
        self._recover(why)
        return self._wait_generation(after=self.generation, timeout_s=self.cfg.timeout_s)

    def membership(self) -> dict:
        """What a checkpoint records besides the state: the membership it was taken in (a resume
        continues on that generation's plan)."""
        return {"global_batch": self.trainer.global_batch, "members": self.members, "generation": self.generation}

    def _recover(self, why: str) -> None:
        """Drop the step's gradients and this group at once (outside the ``except``, so the
        traceback no longer holds DDP): closing our connections fails the collectives that other
        survivors are still blocked in, instead of leaving them to the collective timeout."""
        log.warning("worker %d: step %d failed (%s); waiting for the next generation", self.wid, self.step, why)
        self.trainer.optimizer.zero_grad(set_to_none=True)
        if self.trainer.runtime.backend == "gloo":  # NCCL's survivors find out by their collective timeout
            _sever_peer_connections(self.cfg.store_port)
        self._drop_group(failed=True)
        gc.collect()
        # Probing takes up to a second; not worth it once the coordinator has re-formed the job (a
        # member found dead by its heartbeat), only when it may be waiting on these reports.
        decided = self.heartbeat.generation > self.generation
        self.reader.write(
            keys.stuck(self.generation, self.wid),
            StuckDoc.KIND.value,
            StuckDoc(why, [] if decided else unreachable(self._peer_probes()), step=self.step).to_body(),
            generation=self.generation,
        )

    def _peer_probes(self) -> dict[int, str]:
        """The other members of this generation and where to probe them (from their arrival)."""
        probes = {}
        for rank, wid in enumerate(self.members):
            doc = self.reader.read_doc(keys.arrived(self.generation, rank), ArrivedDoc, generation=self.generation)
            if wid != self.wid and doc is not None and doc.worker_id == wid and doc.probe:
                probes[wid] = doc.probe
        return probes

    def _merge_unsettled(self) -> None:
        """After a failure, members of a mode at its own pace hold different parameters (each its
        own progress since it last merged): they take the mean of theirs, and go on from the data
        position past every sample claimed before the failure. The failed member's progress that
        it had not yet merged (what it pushed to no one, or its last claimed samples) is lost with
        it, as in any asynchronous mode; a newcomer brings no state and takes the others'."""
        t = self.trainer
        store, self.unsettled_store = self.unsettled_store, None
        holds_state = store is not None
        flat = t.flat_params() if holds_state else torch.zeros_like(t.flat_params())
        facts = torch.tensor([float(holds_state)], dtype=torch.float64, device=t.runtime.device)
        dist.all_reduce(flat)
        dist.all_reduce(facts)
        position = torch.tensor([claimed_position(t, store) if holds_state else 0], device=t.runtime.device)
        dist.all_reduce(position, op=dist.ReduceOp.MAX)
        if holds_state:
            t.set_flat_params(flat / float(facts.item()))
            adopt_claimed_position(t, int(position.item()))

    def close(self) -> None:
        self.heartbeat.stopped.set()
        self.probe.close()
        self._drop_group()


class Superseded(Exception):
    """A newer generation was published while the members of one gathered."""

    def __init__(self, generation: int):
        super().__init__(f"generation {generation} was published")
        self.generation = generation


def _sever_peer_connections(store_port: int) -> None:
    """Shut down this process's TCP connections to its peers (all but the store's): a survivor
    blocked in a collective waiting on *this* worker then fails at once instead of after the
    collective timeout. Destroying the group alone does not do it while gloo still holds the
    pairs of the failed operation."""
    import socket as socketlib

    import psutil

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


def _nccl_errors_reach_the_caller() -> None:
    """Make a collective that a lost peer never completes raise in the training thread after the
    collective timeout (blocking wait), where the loop survives it, instead of hanging on the GPU
    or having NCCL's watchdog end the whole process (its default). Read when a group is made."""
    os.environ["TORCH_NCCL_BLOCKING_WAIT"] = "1"
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"


def _warm_up(trainer: Trainer) -> None:
    """One forward and backward on a micro-batch, gradients dropped: first-call costs are paid now."""
    inputs, targets = trainer.batch(range(min(trainer.micro_batch, trainer.global_batch)))
    trainer.bundle.loss(trainer.model(inputs), targets).backward()
    trainer.optimizer.zero_grad(set_to_none=True)


def _check_plan(plan) -> None:
    if not rescalable(plan):
        raise InputError(
            f"elastic training runs data-parallel plans (one stage) with sync "
            f"{' or '.join(m.value for m in RESCALABLE_SYNC)}; this plan has {len(plan.stages)} "
            f"stage(s) and sync {plan.sync.mode.value}"
        )


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


def run_elastic(cfg: WorkerConfig) -> dict:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: where is a stuck worker?
    worker = ElasticWorker(cfg)
    try:
        strategy = worker.start()
        start = time.perf_counter()
        finished = train(worker.trainer, strategy, worker)
        wall_s = time.perf_counter() - start
        if finished:
            worker.trainer.final_checkpoint()
            worker.trainer.totals["heartbeat_cpu_s"] = round(worker.heartbeat.cpu_s, 6)
            worker.trainer.finish(wall_s)
            dist.barrier()
            worker.reader.write(
                keys.done(worker.wid), DoneDoc.KIND.value, DoneDoc(worker.step).to_body(), generation=worker.generation
            )
        return dict(worker.trainer.totals, wall_s=wall_s, left=not finished)
    finally:
        worker.close()
