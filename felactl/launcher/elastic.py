"""The coordinator's side of live rescaling: signed scale commands, failures, new generations.

The launch process polls :meth:`ElasticController.poll` between its other chores. It

* pops ``felactl scale`` requests from the store queue ``<job>elastic/scale/requests``; each is
  ``{id, command, signature = sign(secret, "scale|id|command")}``. A wrong signature or a replayed
  id is refused, logged in ``events.jsonl`` and changes nothing; so is a request that cannot be
  met (more workers than the node's slots, an unknown worker, removing the last one). The answer
  goes under ``scale/reply/<id>``.
* scales out by asking the node's agent (a signed ``add`` command) to start newcomers, waiting
  until each says ``ready`` (torch imported, model built: start-up happens while the job trains),
  re-planning (felactl.launcher.scale_plan), and only then publishing the next generation;
* scales in by publishing a generation without the removed workers (they leave after the step);
* drops a member whose process ended or whose heartbeat has not moved for ``heartbeat_timeout_s``
  (killing it through its agent, so peers blocked in a collective with it fail at once), then
  publishes a generation of the survivors.

Each change waits for every member's ``switched`` report and appends one event: kind, members
before and after, ``pause_s`` (the longest gap, on workers that stayed, between their last step
before and their first step after), bytes replicated and from whom. Worker ids (``rank`` in
metrics) are stable across generations; the ``--remove`` ranks are those ids.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from felactl.agents.agent import AGENT_BEAT_S, command_queue
from felactl.errors import InputError, WorkerFailed
from felactl.launcher.controlplane import (Assignment, Coordinator, Member, agent_beat_key, signed_envelope,
                                           verify)
from felactl.launcher.rundir import RunDir, append_jsonl, read_jsonl
from felactl.launcher.scale_plan import REPLAN_TIME_LIMIT_S, ScalingPolicy, replan, replan_with_planner
from felactl.spec import Plan, load_cluster, load_model, save

log = logging.getLogger(__name__)
POLL_S = 0.02
FAILURE_REPLAN_TIME_LIMIT_S = 2.0
"""Survivors of a failure wait while the coordinator re-plans: the solver gets less time."""
RECENT_METRICS_BYTES = 256 << 10
"""How much of metrics.jsonl's end a re-plan by measured speeds reads (~200 records of ~150 B,
with room): a run of a million steps is not read whole at each rescale."""


class JobFinished(InputError):
    """The workers that would stay finished their last step before a change could take effect."""


@dataclass(frozen=True, kw_only=True)
class ElasticSettings:
    policy: ScalingPolicy = field(default_factory=ScalingPolicy)
    heartbeat_timeout_s: float = 5.0
    max_nproc_per_node: int | None = None
    """Worker slots per node; default: GPUs, or for a CPU node its cores."""
    ready_timeout_s: float = 60.0
    switch_timeout_s: float = 60.0


@dataclass
class _Worker:
    device: str
    node: str
    agent_id: str
    since: float = field(default_factory=time.monotonic)
    beat: str | None = None


class ElasticController:
    def __init__(self, coordinator: Coordinator, run: RunDir, plan: Plan, members: list[Member],
                 nodes: dict[str, tuple[str, ...]], settings: ElasticSettings, start_generation: int = 0,
                 plan_path=None, worker: tuple[str, dict[str, str]] | None = None):
        self.coordinator, self.run, self.plan, self.settings = coordinator, run, plan, settings
        # What an agent that joins mid-job is told to run: the launch's worker module and environment.
        self.worker_module, self.worker_env = worker or ("felactl.agents.worker", {})
        self.joined: dict[str, Assignment] = {}
        self.store = coordinator.store
        self.kv = coordinator.prefix + "elastic/"
        self.agents = {m.node_name: m for m in members}
        self.workers: dict[int, _Worker] = {}
        for node, devices in nodes.items():
            for d in devices:
                self.workers[plan.rank_of(d)] = _Worker(d, node, self.agents[node].agent_id)
        self.members = sorted(self.workers)
        self.base = (plan.global_batch, plan.training.lr, len(self.members))
        self.generation = start_generation
        self.next_id = len(self.members)
        self.seen_ids: set[str] = set()
        self.agent_beats: dict[str, tuple[str | None, float]] = {}
        self.stuck_since: float | None = None
        self.first_plan = (start_generation, plan_path or run.plan)
        # With the profiles the plan came from, every change runs the planner again on them.
        self.profiles = (load_cluster(run.cluster), load_model(run.model)) if run.cluster.exists() else None
        self.store.set(self.kv + "generation", str(self.generation))

    # --- the loop's step --------------------------------------------------------------------------
    def poll(self) -> bool:
        """Handle failures and commands; True once every member has finished its last step."""
        self._admit_joiners()
        for node in self.agents:  # follow each agent's beat, so its silence is timed from its last one
            self._agent_silent_s(node)
        dead = self._dead(self.members)
        if dead:
            self._drop(dead)
        elif self._stuck_long():
            try:
                self._switch(list(self.members), "re-form", planned=(self.plan, {"planned_by": "unchanged"}),
                             reason="a collective failed with every member alive")
            except JobFinished:
                pass  # everyone finished meanwhile: nothing to re-form
        self._serve_requests()
        return all(self.store.check([f"{self.kv}done/{w}"]) for w in self.members)

    def _admit_joiners(self) -> None:
        """A ``felactl agent`` joining the running job — a new node, or a node whose agent died —
        is given no workers; ``felactl scale --add N --node NAME`` starts them there."""
        for member in self.coordinator.poll_joins():
            node, old = member.node_name, self.agents.get(member.node_name)
            if old is not None and self._agent_silent_s(node) is None:
                log.warning("elastic: agent %s joined for node %r, whose agent still answers; ignored",
                            member.agent_id, node)
                continue
            self.agents[node] = member
            self.joined[member.agent_id] = Assignment(rank_offset=0, world_size=1, module=self.worker_module,
                                                      env=dict(self.worker_env), num_workers=0)
            self.coordinator.publish_assignments(self.joined)
            append_jsonl(self.run.events, {"time": time.time(), "kind": "node-joined", "node": node,
                                           "agent": member.agent_id, "replaces": old.agent_id if old else None,
                                           "members": list(self.members)})

    def _stuck_long(self) -> bool:
        """A member said its step failed, and for a heartbeat timeout since nobody was found dead."""
        if not any(self.store.check([f"{self.kv}stuck/{self.generation}/{w}"]) for w in self.members):
            self.stuck_since = None
            return False
        now = time.monotonic()
        self.stuck_since = self.stuck_since or now
        return now - self.stuck_since > self.settings.heartbeat_timeout_s

    def _agent_silent_s(self, node: str, grace_s: float | None = None) -> float | None:
        """Seconds the agent of ``node`` has been silent, once past ``grace_s`` (default: the
        heartbeat timeout); else None."""
        agent_id = self.agents[node].agent_id
        key = agent_beat_key(self.coordinator.prefix, agent_id)
        beat = self.store.get(key).decode() if self.store.check([key]) else None
        last = self.agent_beats.get(agent_id)
        now = time.monotonic()
        if last is None or last[0] != beat:
            self.agent_beats[agent_id] = last = (beat, now)
        silent = now - last[1]
        grace = grace_s if grace_s is not None else self.settings.heartbeat_timeout_s
        if beat is None:
            grace = max(grace, self.settings.ready_timeout_s)
        return silent if silent > grace else None

    def _tables(self) -> dict[str, dict]:
        table = {}
        for member in self.agents.values():
            state = self.coordinator.agent_state(member.agent_id) or {}
            table.update(state.get("workers", {}))
        return table

    def _dead(self, wids: list[int]) -> dict[int, str]:
        """Members whose process ended unasked or whose heartbeat stopped, with why."""
        table, now, dead = self._tables(), time.monotonic(), {}
        for wid in wids:
            w, entry = self.workers[wid], table.get(str(wid))
            if entry and entry.get("exit_code") is not None and not self.store.check([f"{self.kv}done/{wid}"]):
                dead[wid] = f"worker {wid} exited with code {entry['exit_code']}" + (
                    f": {entry['failure']}" if entry.get("failure") else "")
                continue
            key = f"{self.kv}hb/{wid}"
            beat = self.store.get(key).decode() if self.store.check([key]) else None
            if beat != w.beat:
                w.beat, w.since = beat, now
            grace = self.settings.heartbeat_timeout_s if beat is not None else self.settings.ready_timeout_s
            if now - w.since > grace and not self.store.check([f"{self.kv}done/{wid}"]):
                dead[wid] = f"worker {wid}: no heartbeat for {now - w.since:.1f} s"
                # Its worker's silence and the agent's start within a beat of each other: two
                # missed agent beats (and a half, for a busy machine) tell the agent is gone with it.
                if self._agent_silent_s(w.node, grace_s=2.5 * AGENT_BEAT_S) is not None:
                    dead[wid] += f" (the agent of node {w.node!r} is gone too)"
        return dead

    def _drop(self, dead: dict[int, str]) -> None:
        for wid in dead:
            self._command(wid, {"op": "kill", "worker_id": wid})
        survivors = [w for w in self.members if w not in dead]
        if not survivors:
            raise WorkerFailed(f"worker failed: no worker is left ({'; '.join(dead.values())}); logs in "
                               f"{self.run.logs}; a run with checkpoints continues with "
                               f"`felactl launch --resume {self.run.run_id}`")
        log.warning("elastic: dropping %s", "; ".join(dead.values()))
        try:
            self._switch(survivors, "failure", planned=self._plan_for_survivors(survivors),
                         reason="; ".join(dead.values()))
        except JobFinished:
            # The survivors finished: they are the members now (the dead never writes done/).
            self.members = survivors
            log.warning("elastic: the survivors had already finished; nothing to re-form")

    def _plan_for_survivors(self, survivors: list[int]) -> tuple[Plan, dict]:
        """A failure must not end the job: if the planner finds nothing for the survivors, they
        keep the launched stage with shares by measured speed."""
        try:
            return self._plan_for(survivors, time_limit_s=FAILURE_REPLAN_TIME_LIMIT_S)
        except Exception as exc:  # a failure must never end the job because of the planner
            log.warning("elastic: %s; re-planning by measured speeds instead", exc)
            plan, how = self._plan_for(survivors, use_profiles=False)
            return plan, {**how, "planner_refused": str(exc)}

    def _command(self, wid: int, command: dict) -> None:
        agent_id = self.workers[wid].agent_id
        self.store.queue_push(command_queue(self.coordinator.prefix, agent_id),
                              signed_envelope(self.coordinator.secret, "command", command))

    # --- scale requests -------------------------------------------------------------------------
    def _serve_requests(self) -> None:
        queue = self.kv + "scale/requests"
        while self.store.queue_len(queue) > 0:
            raw = self.store.queue_pop(queue, block=False)
            request_id, answer = self._answer(raw)
            if request_id:
                self.store.set(f"{self.kv}scale/reply/{request_id}", json.dumps(answer))

    def _answer(self, raw: bytes) -> tuple[str, dict]:
        try:
            request = json.loads(raw)
            request_id, text, signature = str(request["id"]), str(request["command"]), str(request["signature"])
            command = json.loads(text)
        except (ValueError, KeyError, TypeError):
            self._refuse("a malformed scale request")
            return "", {}
        if not request_id.isalnum() or len(request_id) > 64:
            self._refuse("a scale request with a bad id")
            return "", {}
        if not verify(self.coordinator.secret, f"scale|{request_id}|{text}", signature):
            return request_id, self._refuse("the scale command is not signed with this job's secret", command)
        if request_id in self.seen_ids:
            return request_id, self._refuse("a replayed scale command", command)
        self.seen_ids.add(request_id)
        try:
            return request_id, {"ok": True, "result": self._execute(command)}
        except InputError as exc:
            return request_id, self._refuse(str(exc), command)

    def _refuse(self, reason: str, command: dict | None = None) -> dict:
        log.warning("elastic: refused %s", reason)
        append_jsonl(self.run.events, {"time": time.time(), "kind": "refused", "reason": reason,
                                       "command": command, "members": list(self.members)})
        return {"ok": False, "error": reason}

    def _execute(self, command: dict) -> dict:
        op = command.get("op")
        policy = ScalingPolicy(command["scaling_policy"], command.get("max_batch")) \
            if command.get("scaling_policy") else None
        if op == "add":
            return self._add(int(command.get("count", 0)), command.get("node"), policy)
        if op == "remove":
            return self._remove([int(r) for r in command.get("ranks", [])], policy)
        if op == "to":
            target = int(command.get("count", 0))
            if target < 1:
                raise InputError(f"--to {target}: a job needs at least one worker")
            if target > len(self.members):
                return self._add(target - len(self.members), command.get("node"), policy)
            if target < len(self.members):
                return self._remove(self.members[target:], policy)
            return {"kind": "unchanged", "members": list(self.members), "generation": self.generation}
        raise InputError(f"unknown scale operation {op!r}")

    def capacity(self, node: str) -> int:
        if self.settings.max_nproc_per_node is not None:
            return self.settings.max_nproc_per_node
        profiled = self._profiled_node(node)
        if profiled is not None:
            return len(profiled.devices)
        info = self.agents[node].info
        return int(info.get("num_gpus") or info.get("num_cpu_cores") or self.agents[node].num_slots)

    def _add(self, count: int, node: str | None, policy: ScalingPolicy | None) -> dict:
        if count < 1:
            raise InputError(f"--add {count}: add at least one worker")
        node = node or next(iter(self.agents))
        if node not in self.agents:
            raise InputError(f"--node {node!r}: no agent of this job runs there (nodes: {', '.join(self.agents)})")
        silent_s = self._agent_silent_s(node)
        if silent_s is not None:
            raise InputError(f"--node {node!r}: its agent has not answered for {silent_s:.1f} s (killed or "
                             "unreachable); add workers on another node or restart `felactl agent` there")
        used = sum(1 for w in self.members if self.workers[w].node == node)
        slots = self.capacity(node)
        if used + count > slots:
            where = ("device(s) in the run's cluster profile" if self._profiled_node(node) is not None
                     and self.settings.max_nproc_per_node is None else "worker slot(s)")
            raise InputError(f"node {node!r} has {slots} {where} and {used} in use: cannot add {count} "
                             "(a CPU node offers one slot per core; launch with --max-nproc-per-node to allow more)")
        newcomers = self._start_newcomers(count, node)
        try:  # planning runs while the newcomers import torch and build the model
            members = self.members + newcomers
            planned = self._plan_for(members, policy)
            self._wait_ready(newcomers)
            if self.members + newcomers != members:  # a member died meanwhile: plan for who is left
                members = self.members + newcomers
                planned = self._plan_for(members, policy)
        except JobFinished:
            raise
        except Exception as exc:
            self._abandon(newcomers)
            if isinstance(exc, InputError):
                raise
            raise InputError(f"re-planning for the new membership failed ({type(exc).__name__}: {exc}); "
                             "nothing changed") from exc
        return self._switch(members, "scale-out", planned=planned)

    def _start_newcomers(self, count: int, node: str) -> list[int]:
        """Ask ``node``'s agent for ``count`` more workers; they start while the job trains."""
        devices = self._free_devices(node, count)
        newcomers = []
        for device in devices:
            wid, self.next_id = self.next_id, self.next_id + 1
            self.workers[wid] = _Worker(device, node, self.agents[node].agent_id)
            newcomers.append(wid)
            env = {"FELACTL_WORKER_ID": str(wid), "FELACTL_JOIN": "1", "RANK": "0", "WORLD_SIZE": "1",
                   "FELACTL_PLAN": str(self._plan_path(self.generation).resolve())}
            if self._profiled_node(node) is not None:  # the device's own index (its GPU), not a count
                index = next(i for i, d in enumerate(self._profiled_node(node).devices) if d.name == device)
                local_index = self.profiles[0].device(device).local_index
                env["LOCAL_RANK"] = str(index if local_index is None else local_index)
            self._command(wid, {"op": "add", "worker_id": wid, "env": env})
        return newcomers

    def _free_devices(self, node: str, count: int) -> list[str]:
        """Names for newcomers: the profile's devices of ``node`` that no member holds (so the
        planner knows them); without a profile, ``cpu<id>``."""
        taken = {self.workers[w].device for w in self.members}
        if self.profiles is None:
            return [f"cpu{self.next_id + i}" if f"cpu{self.next_id + i}" not in taken else f"w{self.next_id + i}"
                    for i in range(count)]
        profiled = self._profiled_node(node)
        if profiled is None:
            raise InputError(f"node {node!r} is not in the run's cluster profile: the planner cannot place workers there")
        free = [d.name for d in profiled.devices if d.name not in taken]
        if len(free) < count:
            raise InputError(f"node {node!r} has {len(free)} free device(s) in the run's cluster profile "
                             f"({len(profiled.devices)} in all): cannot add {count}; the planner places workers on "
                             f"profiled devices only (profile the node with more slots, e.g. felactl profile "
                             f"--nproc-per-node {len(profiled.devices) + count}, for the next launch)")
        return free[:count]

    def _profiled_node(self, node: str):
        return None if self.profiles is None else next((n for n in self.profiles[0].nodes if n.name == node), None)

    def _wait_ready(self, newcomers: list[int]) -> None:
        deadline = time.monotonic() + self.settings.ready_timeout_s
        waiting = set(newcomers)
        while waiting:
            waiting = {w for w in waiting if not self.store.check([f"{self.kv}ready/{w}"])}
            failed = self._dead(sorted(waiting))
            failed = {w: why for w, why in failed.items() if "exited" in why}
            if failed or (waiting and time.monotonic() > deadline):
                for wid in newcomers:
                    self._command(wid, {"op": "kill", "worker_id": wid})
                why = "; ".join(failed.values()) or f"not ready within {self.settings.ready_timeout_s:g} s"
                raise InputError(f"the new worker(s) did not start ({why}); see {self.run.logs}")
            dead = self._dead(self.members)
            if dead:
                self._drop(dead)
            if self._all_done(self.members):
                self._abandon(newcomers)
                raise JobFinished("the job finished its last step while the new worker(s) were starting; "
                                  "nothing changed")
            time.sleep(POLL_S)

    def _all_done(self, wids: list[int]) -> bool:
        return all(self.store.check([f"{self.kv}done/{w}"]) for w in wids)

    def _abandon(self, wids: list[int]) -> None:
        """Stop workers that never joined a generation and forget them."""
        for wid in wids:
            self._command(wid, {"op": "kill", "worker_id": wid})
            self.workers.pop(wid, None)

    def _remove(self, wids: list[int], policy: ScalingPolicy | None) -> dict:
        unknown = [w for w in wids if w not in self.members]
        if unknown:
            raise InputError(f"--remove {unknown[0]}: no such worker in the job (workers: "
                             f"{', '.join(map(str, self.members))})")
        stay = [w for w in self.members if w not in wids]
        if not stay:
            raise InputError("cannot remove every worker: at least one must stay (stop the job instead)")
        return self._switch(stay, "scale-in", planned=self._plan_for(stay, policy))

    # --- a new generation -----------------------------------------------------------------------
    def _plan_path(self, generation: int):
        if generation == self.first_plan[0]:
            return self.first_plan[1]
        return self.run.path / f"plan.{generation}.yaml"

    def _speeds(self) -> dict[str, float]:
        recent: dict[int, list[dict]] = {}
        for r in read_jsonl(self.run.metrics, tail_bytes=RECENT_METRICS_BYTES)[-200:]:
            recent.setdefault(int(r["rank"]), []).append(r)
        speeds = {}
        for wid, records in recent.items():
            compute_s = sum(r["compute_s"] for r in records[-5:])
            if wid in self.workers and compute_s > 0:
                speeds[self.workers[wid].device] = sum(r["samples"] for r in records[-5:]) / compute_s
        return speeds

    def _plan_for(self, members: list[int], policy: ScalingPolicy | None = None,
                  time_limit_s: float = REPLAN_TIME_LIMIT_S, use_profiles: bool = True) -> tuple[Plan, dict]:
        """The plan for ``members`` (rank order) and how it was made: the planner on the run's
        profiles where it has them (and ``use_profiles``), else the launched plan's stage with
        shares by measured speed."""
        policy = policy or self.settings.policy
        batch, lr = policy.batch_and_lr(*self.base[:2], self.base[2], len(members))
        devices = [self.workers[w].device for w in members]
        nodes = {self.workers[w].device: self.workers[w].node for w in members}
        began = time.perf_counter()
        if self.profiles is not None and use_profiles:
            plan = replan_with_planner(self.plan, *self.profiles, devices, nodes, global_batch=batch, lr=lr,
                                       time_limit_s=time_limit_s)
            how = "planner"
        else:
            plan = replan(self.plan, devices, self._member_speeds(members), nodes, global_batch=batch, lr=lr)
            how = "measured speeds"
        return plan, {"planned_by": how, "plan_s": round(time.perf_counter() - began, 3),
                      "predicted_iteration_s": plan.predicted.iteration_s if plan.predicted else None}

    def _member_speeds(self, members: list[int]) -> dict[str, float]:
        speeds = self._speeds()
        node_speed = {}  # a newcomer runs at the mean speed of its node's workers
        for w in members:
            if self.workers[w].device in speeds:
                node_speed.setdefault(self.workers[w].node, []).append(speeds[self.workers[w].device])
        for w in members:
            d = self.workers[w].device
            if d not in speeds and self.workers[w].node in node_speed:
                values = node_speed[self.workers[w].node]
                speeds[d] = sum(values) / len(values)
        return speeds

    def _switch(self, members: list[int], kind: str, *, planned: tuple[Plan, dict],
                reason: str | None = None) -> dict:
        plan, how = planned
        if list(plan.devices) != [self.workers[w].device for w in members]:
            raise RuntimeError(f"internal: the plan for generation {self.generation + 1} does not list the members' "
                               "devices in rank order")
        generation = self.generation + 1
        plan_path = save(plan, self._plan_path(generation))
        before = list(self.members)
        self.store.set(f"{self.kv}gen/{generation}", json.dumps(
            {"generation": generation, "members": members, "plan": str(plan_path.resolve()), "kind": kind}))
        self.store.set(self.kv + "generation", str(generation))
        previous = self.plan
        self.generation, self.plan, self.members = generation, plan, list(members)
        stayers = [w for w in members if w in before]
        try:
            reports = self._wait_switched(generation, members, stayers)
        except JobFinished:
            # Nobody trains any more: the change is moot. The finished workers are the members
            # again (their done/ marks end the job) and a newcomer that never joined is stopped.
            self.plan, self.members = previous, before
            self._abandon([w for w in members if w not in before])
            raise
        event = {**_event(kind, generation, before, members, reports, plan, reason), **how}
        append_jsonl(self.run.events, event)
        return event

    def _wait_switched(self, generation: int, members: list[int], stayers: list[int]) -> dict[int, dict]:
        deadline = time.monotonic() + self.settings.switch_timeout_s
        reports: dict[int, dict] = {}
        while len(reports) < len(members):
            for w in members:
                key = f"{self.kv}switched/{generation}/{w}"
                if w not in reports and self.store.check([key]):
                    reports[w] = json.loads(self.store.get(key))
            if len(reports) == len(members):
                break
            if stayers and not any(w in reports for w in stayers) and self._all_done(stayers):
                raise JobFinished(f"the job finished its last step before generation {generation} could start; "
                                  "nothing changed")
            dead = self._dead([w for w in members if w not in reports])
            if dead:
                self._drop(dead)
                return reports
            if time.monotonic() > deadline:
                raise WorkerFailed(f"generation {generation}: workers {sorted(set(members) - set(reports))} did not "
                                   f"switch within {self.settings.switch_timeout_s:g} s; see {self.run.logs}")
            time.sleep(POLL_S)
        return reports


def _event(kind: str, generation: int, before: list[int], after: list[int], reports: dict[int, dict],
           plan: Plan, reason: str | None) -> dict:
    stayed = [r["pause_s"] for r in reports.values() if r.get("stayed") and r.get("pause_s") is not None]
    senders: dict[str, int] = {}
    for r in reports.values():
        if r.get("received"):
            for wid, nbytes in r.get("senders", {}).items():
                senders[wid] = senders.get(wid, 0) + int(nbytes)
    event = {"time": time.time(), "kind": kind, "generation": generation, "members_before": before,
             "members_after": after, "added": [w for w in after if w not in before],
             "removed": [w for w in before if w not in after],
             "pause_s": round(max(stayed), 6) if stayed else None,
             "replicated_bytes": sum(senders.values()), "replicated_from": senders,
             "step": max((r.get("step", 0) for r in reports.values()), default=None),
             "global_batch": plan.global_batch, "lr": plan.training.lr,
             "switch_s": {str(w): _timings(r) for w, r in sorted(reports.items())}}
    if reason:
        event["reason"] = reason
    return event


def _timings(report: dict) -> dict:
    """One worker's switch: its pause, re-form, replication and DDP times, and its parameters' checksum."""
    out = {k: round(report[k], 4) for k in ("pause_s", "form_s", "replicate_s", "wrap_s") if report.get(k) is not None}
    if report.get("param_checksum") is not None:
        out["param_checksum"] = report["param_checksum"]
    return out


def refuse_requests(coordinator: Coordinator, run: RunDir, reason: str) -> None:
    """A job that cannot be rescaled still answers ``felactl scale`` (refused, logged), never leaves it waiting."""
    store, prefix = coordinator.store, coordinator.prefix + "elastic/"
    queue = prefix + "scale/requests"
    while store.queue_len(queue) > 0:
        raw = store.queue_pop(queue, block=False)
        try:
            request_id = str(json.loads(raw)["id"])
        except (ValueError, KeyError, TypeError):
            continue
        if request_id.isalnum() and len(request_id) <= 64:
            append_jsonl(run.events, {"time": time.time(), "kind": "refused", "reason": reason})
            store.set(f"{prefix}scale/reply/{request_id}", json.dumps({"ok": False, "error": reason}))
