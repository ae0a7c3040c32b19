"""What the elastic controller sees at each poll: a :class:`~felactl.launcher.membership.state.Seen`
gathered from the store (signed heartbeats, ``done``, ``ready``, ``stuck`` and ``switched``
documents, agents' beats, ``felactl scale`` requests) and from the agents' reports (exit codes).

Looking is apart from deciding (:mod:`felactl.launcher.membership`) and from doing
(:class:`felactl.launcher.elastic.ElasticController`): it changes nothing but what it takes in
(the store's request queue, a switch's reports). A forged or unreadable document counts as
absent: a forged heartbeat neither revives a silent worker nor silences a live one.
"""

from __future__ import annotations

import time

from felactl.control import keys
from felactl.control.documents import DoneDoc, HeartbeatDoc, ReadyDoc, StuckDoc, SwitchedDoc
from felactl.control.seal import Opened
from felactl.launcher.controlplane import Coordinator, Member
from felactl.launcher.membership.state import Exit, Join, Request, Seen, State, Stuck, Switching
from felactl.launcher.scale_requests import open_request


class Lookout:
    """Reads one job's store through its coordinator (which also audits the keys it owns)."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator
        self.store = coordinator.store
        self.reader = coordinator.reader

    def look(self, state: State, reports: dict[int, dict] | None) -> Seen:
        """What the store and the agents' reports show of ``state``'s workers and agents now;
        ``reports``: the switch under way's ``switched`` reports so far, to which the new ones
        are added (kept for its event)."""
        self.coordinator.audit()
        joins = tuple(Join(m.node_name, m.agent_id, offered_slots(m)) for m in self.coordinator.poll_joins())
        watched = set(state.members) | set(state.starting.newcomers if state.starting else ())
        table = self.tables(state)
        exits = {
            w: Exit(int(table[str(w)]["exit_code"]), table[str(w)].get("failure"))
            for w in watched
            if table.get(str(w), {}).get("exit_code") is not None
        }
        beats = {w: opened for w in watched if (opened := self._beat(w)) is not None}
        heartbeats = {w: str(opened.seq) for w, opened in beats.items()}
        started = frozenset(w for w, opened in beats.items() if _started(opened.body))
        # Every member's done mark is read (not just until one is missing): every forgery is noticed.
        done = frozenset([w for w in watched if w not in state.done and self._is_done(w)])
        stuck = {} if state.switching is not None else self._stuck_reports(state)
        ready = (
            frozenset()
            if state.starting is None
            else frozenset(
                w
                for w in state.starting.newcomers
                if w not in state.starting.ready and self.reader.read(keys.ready(w), ReadyDoc.KIND.value) is not None
            )
        )
        switched = frozenset() if state.switching is None else self._read_reports(state.switching, reports)
        agent_beats = {a.agent_id: self.coordinator.agent_beat(a.agent_id) for a in state.agents.values()}
        return Seen(
            now=time.monotonic(),
            joins=joins,
            agent_beats=agent_beats,
            heartbeats=heartbeats,
            exits=exits,
            started=started,
            done=done,
            stuck=stuck,
            ready=ready,
            switched=switched,
            requests=self._pop_requests(),
        )

    def tables(self, state: State) -> dict[str, dict]:
        """Worker id -> what its agent last reported of it (exit code, failure, log)."""
        table = {}
        for agent in state.agents.values():
            reported = self.coordinator.agent_state(agent.agent_id) or {}
            table.update(reported.get("workers", {}))
        return table

    def _beat(self, wid: int) -> Opened | None:
        """The newest valid heartbeat of ``wid``, else None: a forged or replayed beat does not
        keep a silent worker alive, and garbage does not make a live one silent."""
        return self.reader.read(keys.heartbeat(wid), HeartbeatDoc.KIND.value)

    def _is_done(self, wid: int) -> bool:
        """Whether worker ``wid`` finished its last step: a valid signed ``done`` (a forged one is refused)."""
        return self.reader.read(keys.done(wid), DoneDoc.KIND.value) is not None

    def _stuck_reports(self, state: State) -> dict[int, Stuck]:
        """The members whose step failed in this generation, each with its report."""
        generation, members, reports = state.generation, state.members, {}
        for w in members:
            doc = self.reader.read_doc(keys.stuck(generation, w), StuckDoc, generation=generation)
            if doc is not None:
                unreachable = frozenset(v for v in doc.unreachable if isinstance(v, int) and v in members)
                reports[w] = Stuck(unreachable, doc.step, doc.why)
        return reports

    def _read_reports(self, switching: Switching, reports: dict[int, dict]) -> frozenset[int]:
        """The members that reported the generation being switched to (their reports kept for its event)."""
        generation = switching.generation
        for w in switching.members:
            if w not in reports:
                opened = self.reader.read(keys.switched(generation, w), SwitchedDoc.KIND.value, generation=generation)
                if opened is not None and isinstance(opened.body.get("report"), dict):
                    reports[w] = opened.body["report"]
        return frozenset(reports)

    def _pop_requests(self) -> tuple[Request, ...]:
        queue, requests = self.coordinator.prefix + keys.SCALE_REQUESTS, []
        while self.store.queue_len(queue) > 0:
            request_id, command, why = open_request(self.coordinator, self.store.queue_pop(queue, block=False))
            requests.append(Request(request_id, command, why))
        return tuple(requests)


def _started(heartbeat: dict) -> bool:
    """Whether a heartbeat says its worker has started: it counts its steps done from 0 once its
    model is built and its group formed (-1 before)."""
    step = heartbeat.get("step")
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0


def offered_slots(member: Member) -> int:
    """The worker slots an agent offers: its GPUs, else its cores, else what it asked for."""
    info = member.info
    return int(info.get("num_gpus") or info.get("num_cpu_cores") or member.num_slots)
