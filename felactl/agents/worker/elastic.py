"""The membership of an elastic job: data-parallel training under live rescaling (Elan's three
mechanisms, on the worker's side).

Membership generations. The coordinator (felactl.launcher.elastic) publishes generation ``G``
(:mod:`felactl.agents.worker.generations`); each worker's heartbeat thread watches for it off the
training thread, and after each step the strategy decides where the members switch
(:meth:`Strategy.generation_to_switch_to`): BSP folds the newest generation each member saw into
the one-element all-reduce it already does before the last micro-batch (``MAX``), so all members
agree on the *same* boundary at no extra cost; tokens agree through the store on a step a few
ahead; WBSP and SDPipe settle wherever each member stands.

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
for the next generation and re-forms; the strategy merges what the failure left apart (WBSP,
SDPipe: :meth:`Strategy.merge_after_failure`) and :func:`replicate` aligns anyone who missed a
completed step.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import logging
import os
import sys
import time
from typing import Any

import psutil
import torch.distributed as dist

from felactl.agents.worker.config import WorkerConfig
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.generations import PLANNED, Heartbeat, elastic_prefix, read_generation
from felactl.agents.worker.membership import Membership, load_checked
from felactl.agents.worker.reach import ProbeListener, local_address, sever_peer_connections, unreachable
from felactl.agents.worker.replicate import replicate
from felactl.agents.worker.runtime import Runtime, choose_device, connect_store, form_group
from felactl.agents.worker.strategies import strategy_for
from felactl.agents.worker.strategy import Strategy
from felactl.control import keys
from felactl.control.documents import ArrivedDoc, DoneDoc, LeftDoc, ReadyDoc, StuckDoc, SwitchAtDoc, SwitchedDoc
from felactl.control.seal import parse_int
from felactl.errors import InputError, WorkerFailed
from felactl.spec import Plan, load_plan
from felactl.spec.executable import plan_backend, why_not_rescalable

log = logging.getLogger(__name__)
POLL_S = 0.01
ARRIVAL_REPEAT_S = 0.1


class ElasticMembership(Membership):
    """One worker of an elastic job: its start as an original member or a newcomer, the loop's
    hooks (generations, switching, failures), and the facts its strategy decides on."""

    survives_failures = True

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
        self.switch_plan: dict | None = None
        """Where and to which generation the members agreed, through the store, to switch."""
        self.kinds: dict[int, str] = {}
        """Generation -> its kind, as read (see :meth:`is_planned`)."""
        self.last_step_end = time.perf_counter()
        self.form_s = 0.0
        self.collective_timeout_due = False
        """Whether the group still runs under the start-up timeout (see :meth:`form`)."""
        self.failed_store: dist.Store | None = None
        """After a failure: the failed generation's store, whose data counter says how far the
        members of a mode at its own pace got (see :meth:`Strategy.merge_after_failure`)."""

    @property
    def step(self) -> int:
        return self.trainer.steps_done

    # --- groups -------------------------------------------------------------------------------
    def form(self, rank: int, world_size: int, generation: int) -> Runtime:
        """Form ``generation``'s group, this worker at ``rank`` of ``world_size``, on the backend of
        the plan it trains (the trainer is built before any group is formed)."""
        cfg = dataclasses.replace(self.cfg, rank=rank, world_size=world_size, generation=generation)
        backend = plan_backend(self.trainer.plan)
        if backend == "nccl":
            _nccl_errors_reach_the_caller()
        self._arrive(generation, rank, world_size)
        # A new group runs its first step under the start-up timeout: until every member has done
        # one, a member may still be building its optimizer or running a first forward that
        # compiles or autotunes, and a short collective timeout would fail a healthy job there,
        # before the loop that survives failures has begun. after_step then shortens it.
        runtime = form_group(cfg, self.raw, backend, timeout_s=max(cfg.timeout_s, cfg.collective_timeout_s))
        self.collective_timeout_due = True
        self.generation = generation
        return runtime

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
    def start(self) -> tuple[Trainer, Strategy]:
        """Join the job (an original member, or a newcomer) and return the trainer and the
        strategy to train with. The model, its optimizer and a resume's state are ready before the
        members gather, so what fails in the user's code fails before any peer waits on this worker."""
        self.heartbeat.start()
        if self.cfg.join:
            strategy = self._start_as_newcomer()
        else:
            strategy = self._start_as_member()
        self.heartbeat.say_started(self.step)
        return self.trainer, strategy

    def _start_as_member(self) -> Strategy:
        plan, bundle = load_checked(self.cfg)
        if (why := why_not_rescalable(plan)) is not None:
            raise InputError(f"{self.cfg.plan_path}: elastic training: {why}")
        self.trainer = Trainer(
            self._placeholder_runtime(plan), plan, membership=self, bundle=bundle, metrics_rank=self.wid
        )
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
        return strategy_for(plan)(self.trainer)

    def _placeholder_runtime(self, plan: Plan) -> Runtime:
        """Where the trainer is built for ``plan`` before its group exists: on its device, at this
        worker's rank in the plan (a newcomer's, which learns its own later: 0)."""
        cfg = self.cfg if not self.cfg.join else dataclasses.replace(self.cfg, rank=0, world_size=len(plan.devices))
        backend = plan_backend(plan)
        return Runtime(cfg, self.kv, backend, choose_device(cfg, backend), self.raw)

    def _start_as_newcomer(self) -> Strategy:
        """Everything slow happens here, while the others train: import, build the model and its
        optimizer, open the data, run one warm-up forward and backward; then say ready and wait."""
        template = load_plan(self.cfg.plan_path)
        self.trainer = Trainer(self._placeholder_runtime(template), template, membership=self, metrics_rank=self.wid)
        _warm_up(self.trainer)
        # its log says how long a scale-out waited on it, imports included (the launch gives up after
        # --join-timeout)
        since_start = time.time() - psutil.Process().create_time()
        print(f"worker {self.wid}: ready to join {since_start:.1f} s after it started", file=sys.stderr, flush=True)
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
        self.trainer.start_at(-1, 0)  # behind everyone: replication hands it the state
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

    def switch(self, doc: dict) -> Strategy | None:
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

    def _replicate_and_wrap(self, plan, doc: dict, last_step_end: float, *, stayed: bool) -> Strategy:
        """Bring every member to the same state in ``doc``'s generation (newly formed) and build
        the strategy to go on with, saying how the switch went (``switched/<G>/<id>``)."""
        trainer, kind = self.trainer, strategy_for(plan)
        if doc.get("kind") not in PLANNED:
            kind.merge_after_failure(trainer, self.failed_store)
        self.failed_store = None
        rep = replicate(
            trainer.model,
            trainer.optimizer,
            step=trainer.steps_done,
            data_position=trainer.data_position,
            device=trainer.runtime.device,
            scheduler=trainer.scheduler,
        )
        # the run goes on from the state every member now holds, in this generation's batches
        trainer.start_at(rep.step, rep.data_position)
        self.switch_plan, self.kinds = None, {}
        trainer.apply_plan_lr(plan)  # the hybrid-scaling policy's rate for this membership
        t = time.perf_counter()
        strategy = kind(trainer)
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
                    "lr": trainer.optimizer.param_groups[0]["lr"],  # the job's own, where it brings its optimizer
                }
            ).to_body(),
            generation=doc["generation"],
        )
        return strategy

    # --- the run's end ------------------------------------------------------------------------
    def finish(self, finished: bool, wall_s: float) -> dict[str, Any]:
        """A worker that trained to the end checkpoints, writes its summary and says ``done``;
        one that left on the way (a scale-in) only says so in its totals."""
        if finished:
            extra = {"heartbeat_cpu_s": round(self.heartbeat.cpu_s, 6)}
            self.trainer.final_checkpoint()
            self.trainer.finish(wall_s, extra)
            dist.barrier()
            self.reader.write(
                keys.done(self.wid), DoneDoc.KIND.value, DoneDoc(self.step).to_body(), generation=self.generation
            )
            return dict(self.trainer.totals, **extra, wall_s=wall_s, left=False)
        return dict(self.trainer.totals, wall_s=wall_s, left=True)

    def close(self) -> None:
        self.heartbeat.stopped.set()
        self.probe.close()
        self._drop_group()

    # --- the loop's hooks ---------------------------------------------------------------------
    def record_extra(self) -> dict:
        return {"generation": self.generation, "pid": os.getpid()}

    def after_step(self, strategy: Strategy) -> dict | None:
        """Switch after the step every member agreed on, to the generation they agreed on."""
        self.last_step_end = time.perf_counter()
        self.heartbeat.say_step(self.step)
        if self.collective_timeout_due:  # every member has been through a step of this group
            dist.distributed_c10d._set_pg_timeout(_timedelta(self.cfg.collective_timeout_s))
            self.collective_timeout_due = False
        generation = strategy.generation_to_switch_to(self)
        return None if generation is None else self._doc(generation)

    def after_failure(self, why: str) -> dict:
        """A peer died or hung: wait for the generation the coordinator forms without it."""
        # The members of a mode at its own pace stopped each at a step of its own, unsettled:
        # the next group merges them, from how far this store's data counter says they got.
        self.failed_store = self.trainer.runtime.store
        self._recover(why)
        return self._wait_generation(after=self.generation, timeout_s=self.cfg.timeout_s)

    # --- what the trainer and its strategy ask ------------------------------------------------
    def newest_generation(self) -> int:
        return self.heartbeat.generation

    def is_planned(self, generation: int) -> bool:
        if generation not in self.kinds:  # a scale-out may be followed by a failure: each has its kind
            self.kinds[generation] = self._doc(generation).get("kind", "failure")
        return self.kinds[generation] in PLANNED

    def members_changed(self) -> bool:
        """Whether the coordinator re-forms the job because a member failed (or a step was stuck):
        a wait on the others then never ends. (A planned scale-out or -in is made at a step the
        members agree on; every wait before it ends by itself.)"""
        newest = self.heartbeat.generation
        return newest > self.generation and not self.is_planned(newest)

    def switch_at_agreed_step(self, lead_steps: int) -> int | None:
        if self.switch_plan is None and self.heartbeat.generation > self.generation:
            # The first member to see a new generation proposes to switch a few steps ahead (more
            # than any member runs ahead of another); the store keeps the first proposal for all.
            proposal = SwitchAtDoc(at=self.step + lead_steps, to=self.heartbeat.generation)
            self.switch_plan = self.reader.agree(
                keys.switch_agreement(self.generation),
                SwitchAtDoc.KIND.value,
                proposal.to_body(),
                generation=self.generation,
            )
        if self.switch_plan is not None and self.step >= self.switch_plan["at"]:
            return int(self.switch_plan["to"])
        return None

    def checkpoint_extra(self) -> dict[str, Any]:
        """The membership a checkpoint was taken in (a resume continues on that generation's plan)."""
        return {"global_batch": self.trainer.global_batch, "members": self.members, "generation": self.generation}

    def _recover(self, why: str) -> None:
        """Drop the step's gradients and this group at once (outside the ``except``, so the
        traceback no longer holds DDP): closing our connections fails the collectives that other
        survivors are still blocked in, instead of leaving them to the collective timeout."""
        log.warning("worker %d: step %d failed (%s); waiting for the next generation", self.wid, self.step, why)
        self.trainer.optimizer.zero_grad(set_to_none=True)
        if self.trainer.runtime.backend == "gloo":  # NCCL's survivors find out by their collective timeout
            sever_peer_connections(self.cfg.store_port)
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


class Superseded(Exception):
    """A newer generation was published while the members of one gathered."""

    def __init__(self, generation: int):
        super().__init__(f"generation {generation} was published")
        self.generation = generation


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


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
