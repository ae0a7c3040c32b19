"""The control plane: the secret file, sign/verify, HMAC join, signed documents, and its errors."""

from __future__ import annotations

import json
import socket
import stat
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from felactl.agents.session import AgentSession, StopOrder
from felactl.control import keys
from felactl.control.documents import Assignment
from felactl.control.join import sign, verify
from felactl.control.store import parse_endpoint
from felactl.errors import AuthError, ControlPlaneError, InputError
from felactl.launcher.controlplane import Coordinator, new_secret, read_secret_file, write_secret_file


def test_secret_file_is_private_hex_and_reads_back(tmp_path):
    path = tmp_path / "run" / "secret"
    secret = write_secret_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(secret) == 64 and int(secret, 16) >= 0
    assert read_secret_file(path) == secret
    assert not list(path.parent.glob(".*.tmp"))  # atomic: no temp file left behind


@pytest.mark.parametrize("text", ["", "short", "z" * 64])
def test_bad_secret_file_is_input_error(tmp_path, text):
    path = tmp_path / "secret"
    path.write_text(text)
    with pytest.raises(InputError, match="not a felactl job secret"):
        read_secret_file(path)
    with pytest.raises(InputError, match="no such secret file"):
        read_secret_file(tmp_path / "missing")


def test_sign_verify():
    secret, other = new_secret(), new_secret()
    signature = sign(secret, "scale add 2")
    assert verify(secret, "scale add 2", signature)
    assert not verify(secret, "scale add 3", signature)
    assert not verify(other, "scale add 2", signature)
    assert not verify(secret, "scale add 2", "00" * 32)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("127.0.0.1:29500", ("127.0.0.1", 29500)),
        ("node-1.lab:0", ("node-1.lab", 0)),
        ("::1:80", ("::1", 80)),
        ("[::1]:29500", ("::1", 29500)),
        ("[fe80::1%eth0]:1", ("fe80::1%eth0", 1)),
    ],
)
def test_parse_endpoint(text, expected):
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["nohost", "host:port", ":123", "h:70000"])
def test_parse_endpoint_rejects(text):
    with pytest.raises(InputError, match="HOST:PORT"):
        parse_endpoint(text)


def test_coordinator_listens_on_loopback_only():
    coordinator = Coordinator(new_secret())
    try:
        listening = [
            c
            for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == coordinator.port
        ]
        assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)
    finally:
        coordinator.close()


def test_port_in_use_is_input_error_naming_the_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(InputError, match=f"port {port} .*already in use"):
            Coordinator(new_secret(), endpoint=f"127.0.0.1:{port}")


def test_unreachable_endpoint_times_out_with_control_plane_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connections are refused
    started = time.monotonic()
    with pytest.raises(ControlPlaneError, match=f"cannot reach the coordinator at 127.0.0.1:{port} within 1 s"):
        AgentSession(f"127.0.0.1:{port}", new_secret(), timeout_s=1)
    assert time.monotonic() - started < 15


def test_unreachable_endpoint_says_one_line_without_c10d_noise(capfd):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ControlPlaneError) as caught:
        AgentSession(f"127.0.0.1:{port}", new_secret(), timeout_s=1)
    assert len(str(caught.value).splitlines()) == 1 and "refused" in str(caught.value).lower()
    assert "c10d" not in capfd.readouterr().err  # c10d's C++ log and backtrace never ran


def test_a_coordinator_name_that_does_not_resolve_is_bad_input_at_once():
    started = time.monotonic()
    with pytest.raises(InputError, match="cannot resolve 'no-such-host.invalid'"):
        AgentSession("no-such-host.invalid:29500", new_secret(), timeout_s=30)
    assert time.monotonic() - started < 10  # not the whole join timeout


def test_an_agent_without_a_job_name_joins_the_job_its_coordinator_runs():
    secret = new_secret()
    coordinator = Coordinator(secret, job="run-7")
    try:
        thread, outcome = _join_in_thread(coordinator.endpoint, secret, "nb", 1, job=None)
        _serve_until(coordinator, thread)
        assert "error" not in outcome, outcome
        assert outcome["session"].job == "run-7" and list(coordinator.members) == [outcome["agent_id"]]
    finally:
        coordinator.close()


def _join_in_thread(
    endpoint: str, secret: str, node: str, slots: int, job: str | None = "job", timeout_s: float = 10
) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run() -> None:
        try:
            session = AgentSession(endpoint, secret, timeout_s=timeout_s, job=job)
            outcome["agent_id"] = session.join(node, slots, {"num_cpu_cores": 2})
            outcome["session"] = session
        except Exception as exc:  # handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _serve_until(
    coordinator: Coordinator, thread: threading.Thread, timeout_s: float = 15, before_each_poll=lambda: None
) -> None:
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline:
        before_each_poll()
        coordinator.poll_joins()
        time.sleep(0.02)
    thread.join(timeout=1)
    assert not thread.is_alive()


def test_wrong_secret_is_refused_and_changes_nothing_then_right_secret_joins(caplog):
    caplog.set_level("WARNING", logger="felactl.launcher.controlplane")
    secret = new_secret()
    coordinator = Coordinator(secret)
    try:
        thread, outcome = _join_in_thread(coordinator.endpoint, new_secret(), "intruder", 8, timeout_s=3)
        _serve_until(coordinator, thread)
        assert isinstance(outcome.get("error"), AuthError)
        assert "wrong job secret (check --secret-file)" in str(outcome["error"])
        # The coordinator's refusals are signed with the job's secret, which this agent lacks:
        # it can only tell, at its --join-timeout, that no reply was signed with its own.
        assert "signed with this agent's secret" in str(outcome["error"])
        assert coordinator.members == {} and len(coordinator.refused) >= 1  # a fresh hello each time
        assert {r.getMessage() for r in caplog.records if r.name == "felactl.launcher.controlplane"} == {
            f"control plane: refused agent {coordinator.refused[0]!r}: wrong job secret"
        }

        thread, outcome = _join_in_thread(coordinator.endpoint, secret, "nodeA", 3)
        _serve_until(coordinator, thread)
        assert "error" not in outcome
        member = coordinator.members[outcome["agent_id"]]
        assert (member.node_name, member.num_slots, member.info) == ("nodeA", 3, {"num_cpu_cores": 2})

        coordinator.publish_assignments(
            {member.agent_id: Assignment(rank_offset=0, world_size=3, module="m", env={"A": "1"})}
        )
        assignment = outcome["session"].wait_assignment(5)
        assert (assignment.world_size, assignment.module, assignment.env) == (3, "m", {"A": "1"})
    finally:
        coordinator.close()


class JoinThief:
    """A store client without the secret that takes every join request off the coordinator's
    queue before it polls, answers each join (not hello) with an unsigned refusal, and gives the
    request back ``hold_s`` later (or never, with ``hold_s`` None: the requests vanish)."""

    def __init__(self, coordinator: Coordinator, hold_s: float | None):
        host, port = parse_endpoint(coordinator.endpoint)
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
        self.queue = coordinator.prefix + keys.JOIN_REQUESTS
        self.prefix = coordinator.prefix
        self.hold_s = hold_s
        self.held: list[tuple[float, bytes]] = []
        self.forged = 0

    def __call__(self) -> None:
        while self.store.queue_len(self.queue) > 0:
            raw = self.store.queue_pop(self.queue, block=False)
            request = json.loads(raw)
            if "proof" in request:
                reply = keys.join_reply(request["agent_id"], request["client_nonce"])
                self.store.set(self.prefix + reply, json.dumps({"admitted": False}))
                self.forged += 1
            if self.hold_s is not None:
                self.held.append((time.monotonic() + (self.hold_s if "proof" in request else 0), raw))
        due = [raw for at, raw in self.held if at <= time.monotonic()]
        self.held = [(at, raw) for at, raw in self.held if at > time.monotonic()]
        for raw in due:
            self.store.queue_push(self.queue, raw)


def test_an_unsigned_refusal_locks_no_rightful_agent_out():
    """Issue 30 item 2: a thief answers every join with ``{"admitted": false}`` before the
    coordinator sees it; the agent ignores the unsigned refusal and the coordinator's real,
    signed admission (which overwrites it) lets it in."""
    secret = new_secret()
    coordinator = Coordinator(secret)
    try:
        thief = JoinThief(coordinator, hold_s=0.5)
        thread, outcome = _join_in_thread(coordinator.endpoint, secret, "nodeA", 2)
        _serve_until(coordinator, thread, before_each_poll=thief)
        assert "error" not in outcome, outcome.get("error")
        assert thief.forged >= 1
        assert [m.node_name for m in coordinator.members.values()] == ["nodeA"]
    finally:
        coordinator.close()


def test_an_agent_whose_join_requests_vanish_says_so_and_is_not_told_its_secret_is_wrong(capfd):
    secret = new_secret()
    coordinator = Coordinator(secret)
    try:
        thief = JoinThief(coordinator, hold_s=None)
        thread, outcome = _join_in_thread(coordinator.endpoint, secret, "nodeA", 2, timeout_s=3)
        _serve_until(coordinator, thread, before_each_poll=thief)
        error = outcome.get("error")
        assert isinstance(error, ControlPlaneError) and not isinstance(error, AuthError), error
        assert "no answer from the coordinator" in str(error) and "--join-timeout" in str(error)
        assert "join request" in capfd.readouterr().err  # said while it retries, not only at the end
        assert coordinator.members == {}
    finally:
        coordinator.close()


def test_a_signed_refusal_of_an_altered_request_is_one_attempt_not_a_wrong_secret():
    """A thief that alters the agent's join request on its way makes the coordinator refuse it,
    signed: the agent (whose secret verifies the refusal, so it is the job's) says hello again."""
    secret = new_secret()
    coordinator = Coordinator(secret)
    host, port = parse_endpoint(coordinator.endpoint)
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
    queue = coordinator.prefix + keys.JOIN_REQUESTS
    altered = []

    def alter_first_join() -> None:
        requests = [json.loads(store.queue_pop(queue, block=False)) for _ in range(store.queue_len(queue))]
        for request in requests:
            if "proof" in request and not altered:
                request["payload"] = request["payload"].replace('"num_slots": 2', '"num_slots": 64')
                altered.append(request)
            store.queue_push(queue, json.dumps(request))

    try:
        thread, outcome = _join_in_thread(coordinator.endpoint, secret, "nodeA", 2)
        _serve_until(coordinator, thread, before_each_poll=alter_first_join)
        assert "error" not in outcome, outcome.get("error")
        assert altered and [m.num_slots for m in coordinator.members.values()] == [2]
        assert len(coordinator.refused) == 1
    finally:
        coordinator.close()


def _eventually(check, timeout_s: float = 5.0):
    """TCPStore's set is not acknowledged: a key set on one connection shows on another a little later."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return result


def test_forged_documents_are_ignored_recorded_and_removed(tmp_path):
    """A stop order signed with another secret, or a job document moved to the stop key, is
    ignored by the agent (no exception: the job goes on); the coordinator records it as refused
    and removes it; its own stop order then reaches the agent."""
    from felactl.control import Seal, job_binding
    from felactl.launcher.rundir import read_jsonl

    secret = new_secret()
    events = tmp_path / "events.jsonl"
    coordinator = Coordinator(secret, events=events)
    try:
        thread, outcome = _join_in_thread(coordinator.endpoint, secret, "nodeA", 1)
        _serve_until(coordinator, thread)
        session = outcome["session"]
        assert session.stop_requested() is None
        binding = job_binding(coordinator.job, coordinator.session)
        forged = Seal(new_secret(), binding).seal("stop", "stop", {"reason": "forged"})
        coordinator.store.set(coordinator.prefix + "stop", forged)
        moved = Seal(secret, binding).seal("job", "stop", {"reason": "a job document posing as a stop"})
        for value in (forged, "garbage", moved):
            coordinator.store.set(coordinator.prefix + "stop", value)
            time.sleep(0.1)
            assert session.stop_requested() is None
            coordinator.audit(force=True)
            assert not coordinator.store.check([coordinator.prefix + "stop"])
        reasons = [e["reason"] for e in read_jsonl(events) if e["kind"] == "refused"]
        assert len(reasons) == 3 and all(e["key"] == "stop" for e in read_jsonl(events))
        coordinator.stop("done", drain_s=20)
        assert _eventually(lambda: session.stop_requested() == StopOrder("done", 20.0))
    finally:
        coordinator.close()


def test_lost_coordinator_is_control_plane_error():
    secret = new_secret()
    coordinator = Coordinator(secret)
    thread, outcome = _join_in_thread(coordinator.endpoint, secret, "nodeA", 1)
    _serve_until(coordinator, thread)
    coordinator.close()
    with pytest.raises(ControlPlaneError):
        for _ in range(50):  # the server's shutdown is asynchronous
            outcome["session"].stop_requested()
            time.sleep(0.05)


def test_a_bumped_generation_s_forged_document_is_refused_and_removed_by_the_coordinator(tmp_path):
    """Attack 3 without the race: the coordinator, writing back a generation number it never
    published, also finds the forged document that number points to, records it as refused and
    removes it, whether or not a worker had looked at it yet."""
    import json

    import torch.distributed as dist

    from felactl.control import keys

    events = tmp_path / "events.jsonl"
    coordinator = Coordinator(new_secret(), job="g", events=events)
    try:
        coordinator.own(keys.GENERATION, "0")
        attacker = dist.TCPStore("127.0.0.1", coordinator.port, is_master=False)
        forged = keys.generation_document(5)
        attacker.set(coordinator.prefix + forged, json.dumps({"generation": 5, "members": [0], "plan": "/evil"}))
        attacker.set(coordinator.prefix + keys.GENERATION, "5")
        coordinator.audit(force=True)
        recorded = [json.loads(line) for line in events.read_text().splitlines()]
        assert any(e["kind"] == "refused" and e["key"] == forged for e in recorded), recorded
        assert any(e["kind"] == "repaired" and e["key"] == keys.GENERATION for e in recorded)
        assert not attacker.check([coordinator.prefix + forged])
        assert attacker.get(coordinator.prefix + keys.GENERATION) == b"0"
    finally:
        coordinator.close()


def test_a_second_agent_of_a_node_name_is_refused_while_the_job_gathers_saying_what_to_do():
    """Two agents on one host both take its name: the second is refused with what to give it
    (was: admitted, and the launch ended in an internal KeyError over the node it never got)."""
    secret = new_secret()
    coordinator = Coordinator(secret)
    try:
        first, _ = _join_in_thread(coordinator.endpoint, secret, "vm", 1)
        second, refused = None, {}
        gathered: list = []

        def gather() -> None:
            gathered.extend(coordinator.wait_members(2, timeout_s=8))

        waiting = threading.Thread(target=gather, daemon=True)
        waiting.start()
        first.join(timeout=10)
        second, refused = _join_in_thread(coordinator.endpoint, secret, "vm", 1, timeout_s=5)
        second.join(timeout=10)
        assert isinstance(refused.get("error"), InputError), refused  # at once: trying again changes nothing
        assert "node name taken: 'vm' is agent" in str(refused["error"]) and "--node-name" in str(refused["error"])
        third, joined = _join_in_thread(coordinator.endpoint, secret, "other", 1)
        waiting.join(timeout=10)
        assert sorted(m.node_name for m in gathered) == ["other", "vm"] and "error" not in joined
    finally:
        coordinator.close()


def test_agents_on_one_host_without_node_names_take_distinct_ones():
    """Two `felactl agent`s on one machine, no --node-name: the first is the host's name, the
    second joins as ``<host>-2`` (the launch's --nodes names them so); a name given is not changed."""
    from felactl.agents.node import NodeAgentConfig, _join
    from felactl.agents.session import AgentSession

    secret = new_secret()
    coordinator = Coordinator(secret)
    joined: list = []
    try:
        gathering = threading.Thread(target=lambda: joined.extend(coordinator.wait_members(2, 20)), daemon=True)
        gathering.start()

        def config(given: bool) -> NodeAgentConfig:
            return NodeAgentConfig(
                endpoint=coordinator.endpoint,
                secret=secret,
                node_name="box",
                nproc=1,
                log_dir=Path("."),
                name_given=given,
            )

        names = [
            _join(AgentSession(coordinator.endpoint, secret, timeout_s=10), config(False))[1].node_name
            for _ in range(2)
        ]
        gathering.join(timeout=10)
        assert names == ["box", "box-2"] and sorted(m.node_name for m in joined) == names
        coordinator.gathering = True  # as while a job's first agents gather
        done = threading.Event()

        def serve() -> None:
            while not done.is_set():
                coordinator.poll_joins()
                time.sleep(0.05)

        serving = threading.Thread(target=serve, daemon=True)
        serving.start()
        try:
            with pytest.raises(InputError, match="node name taken"):
                _join(AgentSession(coordinator.endpoint, secret, timeout_s=5), config(True))
        finally:
            done.set()
            serving.join(timeout=5)
    finally:
        coordinator.close()


def test_an_agent_joining_a_running_job_waits_for_its_place_in_the_job_document():
    """A running elastic job's document lists the agents it started with; a newcomer's place is
    added once the coordinator admits it (``ElasticController._admit_agent``). An agent that read
    the document first exited 2, "the job has no place for agent" (tests/test_testbed_jobs.py's
    newcomer, 'not ready within 240 s' in CI): it now waits for its place until its timeout."""
    secret = new_secret()
    coordinator = Coordinator(secret)
    try:
        first = Assignment(rank_offset=0, world_size=1, module="m", env={})
        coordinator.publish_assignments({"someone-else": first})  # the job's start, before the newcomer
        thread, outcome = _join_in_thread(coordinator.endpoint, secret, "nb", 1)
        _serve_until(coordinator, thread)
        session = outcome["session"]
        found = {}
        waiter = threading.Thread(target=lambda: found.setdefault("a", session.wait_assignment(5)), daemon=True)
        waiter.start()
        time.sleep(0.5)  # the agent reads the start's document, without its place, meanwhile
        admitted = Assignment(rank_offset=0, world_size=1, module="m", env={}, num_workers=0, elastic=True)
        coordinator.publish_assignments({"someone-else": first, outcome["agent_id"]: admitted})
        waiter.join(timeout=5)
        assert not waiter.is_alive() and found["a"].num_workers == 0 and found["a"].elastic
    finally:
        coordinator.close()


def test_a_joined_agent_beats_from_a_thread_of_its_own_while_it_is_busy():
    """The coordinator reads an agent's beat (``Coordinator.agent_beat``) to tell a node gone
    from one busy stopping its workers: the beat goes on while the agent's own thread is held
    up, and stops when the agent is done."""
    secret = new_secret()
    coordinator = Coordinator(secret)
    try:
        thread, outcome = _join_in_thread(coordinator.endpoint, secret, "na", 1)
        _serve_until(coordinator, thread)
        session, agent_id = outcome["session"], outcome["agent_id"]
        assert coordinator.agent_beat(agent_id) is None
        with session.beating():
            time.sleep(1.6)  # busy: no call of this thread's beats
            during = int(coordinator.agent_beat(agent_id))
        after = int(coordinator.agent_beat(agent_id))
        time.sleep(0.6)
        assert during >= 2 and int(coordinator.agent_beat(agent_id)) == after
    finally:
        coordinator.close()


def test_an_agents_beat_goes_on_after_a_store_error(monkeypatch):
    """One failed beat (a timeout, a reset) does not end the beating: the first reading's
    thread returned at the first error, and the agent's node was then taken for lost."""
    from felactl.agents import session as session_module

    class FlakyStore:
        def __init__(self):
            self.calls = 0

        def add(self, name, amount):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("Connection reset by peer")

    store = FlakyStore()
    monkeypatch.setattr(session_module, "connect_store", lambda host, port, timeout_s: store)
    agent = object.__new__(AgentSession)
    agent.host, agent.port, agent.timeout_s, agent.prefix, agent.agent_id = "h", 1, 1.0, "p/", "a"
    with agent.beating():
        time.sleep(1.2)
    assert store.calls >= 3
