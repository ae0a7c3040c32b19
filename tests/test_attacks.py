"""Issue 13's eight attacks on a running job's control plane, by a local process without the
secret (a plain TCPStore client on loopback): each is ignored and recorded, or noticed and
repaired, and the job trains every step to the result of an unattacked run.

The attacks a job only has to outlive are made one after another on one shared job
(``attacked``): each test checks its own refusal or repair and that the job trains on, and the
last of them that the job ends as the unattacked run of the same plan (``unattacked``, started
alongside it). An agent locked out and a coordinator posed as get a job each. The attacked jobs
are held back by a gate file (:mod:`_gated_models`: each batch waits while it exists, which
changes no number), so they outlive their attacks; removing it lets them run their last steps
at full speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from felactl import models
from felactl.control import keys
from felactl.launcher.rundir import read_jsonl
from felactl.spec import SyncMode, SyncSpec, Training, save

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
from _gated_models import GATE_ENV  # noqa: E402
from _worker_helpers import MLP_CONFIG, Job, dp_plan, one_node_controller, rescale  # noqa: E402

pytestmark = pytest.mark.multiprocess
STEPS = 120
"""Gated (about 0.3 s a step), 36 s of steps: more than the attacks take on a loaded machine."""
ATTACK_AT = 3
STARTUP_S = 120.0
"""How long a job may take to reach :data:`ATTACK_AT` (two or three start at once on a loaded machine)."""
HEARTBEAT_TIMEOUT_S = 5.0
WAIT_S = 20.0
"""How long a refusal, a repair or a further step may take to show (a bound, not a measurement)."""
SHARED = "a"
"""The run id of the shared attacked job."""


def _launch(tmp_path: Path, run: str, gate: Path | None) -> Job:
    """The mlp of ``dp_plan(2, "bsp")`` as a gated user model; ``gate`` None: at full speed."""
    plan = models.local_data_parallel_plan(
        "_gated_models:gated_mlp",
        MLP_CONFIG,
        2,
        global_batch=32,
        micro_batch=8,
        sync=SyncSpec(mode=SyncMode.BSP),
        training=Training(optimizer="sgd", lr=0.05, seed=0),
    )
    path = save(plan, tmp_path / "plan.yaml")
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    if gate is not None:
        gate.touch()
        env[GATE_ENV] = str(gate)
    return Job(tmp_path, str(path), "--run-id", run, "--steps", str(STEPS), "--max-nproc-per-node", "2", env=env)


def _outcome(job: Job, run: str, summary: dict) -> tuple:
    """What must equal an unattacked run's: every step, the final loss, the parameters."""
    checksums = [
        json.loads((job.root / run / "workers" / f"rank{w}.json").read_text())["param_checksum"] for w in (0, 1)
    ]
    return summary["steps"], round(summary["final_loss"], 6), tuple(round(c, 5) for c in checksums)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Iterator[Job]:
    """The unattacked run, started first so that it runs while the attacked job starts."""
    job = _launch(tmp_path_factory.mktemp("unattacked"), "u", gate=None)
    try:
        yield job
    finally:
        job.stop()


@pytest.fixture(scope="module")
def unattacked(reference) -> tuple:
    return _outcome(reference, "u", reference.finish())


class Shared:
    """The shared attacked job, and its gate."""

    def __init__(self, job: Job, gate: Path):
        self.job, self.gate = job, gate


@pytest.fixture(scope="module")
def attacked(tmp_path_factory, reference) -> Iterator[Shared]:
    tmp_path = tmp_path_factory.mktemp("attacked")
    job = _launch(tmp_path, SHARED, gate=tmp_path / "gate")
    try:
        job.wait_step(SHARED, ATTACK_AT, timeout_s=STARTUP_S)
        yield Shared(job, tmp_path / "gate")
    finally:
        job.stop()


class Attacker:
    """A TCPStore client of the run's control plane, knowing what the run directory shows (the
    endpoint and the agents' ids), not the secret."""

    def __init__(self, job: Job, run: str):
        launch = next(e for e in read_jsonl(job.root / run / "events.jsonl") if e["kind"] == "launch")
        host, port = launch["endpoint"].rsplit(":", 1)
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
        self.prefix = keys.job_prefix(run, 0)
        self.endpoint = launch["endpoint"]

    def set(self, name: str, value: str) -> None:
        self.store.set(self.prefix + name, value)

    def get(self, name: str) -> bytes:
        return self.store.get(self.prefix + name)


def _events(job: Job, run: str) -> list[dict]:
    return read_jsonl(job.root / run / "events.jsonl")


def _refused(job: Job, run: str) -> list[dict]:
    return [e for e in _events(job, run) if e["kind"] == "refused"]


Until = Callable[[list[dict]], bool]


def _seen_since(job: Job, run: str, since: float, until: Until) -> list[dict]:
    """The run's events from ``since`` on, once ``until`` them; fails after :data:`WAIT_S` or
    when the job has ended."""
    deadline = time.monotonic() + WAIT_S
    while True:
        events = [e for e in _events(job, run) if e["time"] >= since]
        if until(events):
            return events
        assert job.proc.poll() is None, f"the job ended: {job.proc.stderr.read().decode()[-2000:]}"
        assert time.monotonic() < deadline, f"not seen within {WAIT_S:g} s; events since: {events}"
        time.sleep(0.05)


def _trains_on(job: Job, run: str) -> None:
    """The job takes a further step, and nobody failed."""
    job.wait_step(run, max(r["step"] for r in job.records(run)) + 1, timeout_s=WAIT_S)
    assert not any(e["kind"] == "failure" for e in _events(job, run))


def _attack(shared: Shared, attack: Callable[[Attacker], None], until: Until) -> list[dict]:
    """Make ``attack`` on the shared job; the events since, once ``until`` them; and the job
    trains on."""
    job = shared.job
    attacked_at = time.time()
    attack(Attacker(job, SHARED))
    events = _seen_since(job, SHARED, attacked_at, until)
    _trains_on(job, SHARED)
    return events


HARM = ("failure", "re-form", "scale-in", "scale-out", "stopped", "finished", "failed")
"""What an attack on the shared job must not cause: a lost member, a re-formed group, a stop or an end."""


def _refused_keys(events: list[dict]) -> set[str]:
    return {e["key"] for e in events if e["kind"] == "refused"}


def _harm(events: list[dict]) -> list[dict]:
    return [e for e in events if e["kind"] in HARM]


def _refusal(what: Callable[[str], bool]) -> Until:
    """Until a refusal at a key that is ``what``."""
    return lambda events: any(e["kind"] == "refused" and what(e["key"]) for e in events)


def test_1_a_forged_stop_is_ignored_and_recorded(attacked, no_leftovers):
    events = _attack(attacked, lambda a: a.set(keys.STOP, "garbage"), _refusal(lambda key: key == keys.STOP))
    assert keys.STOP in _refused_keys(events) and not _harm(events), events


def test_2_forged_done_marks_do_not_finish_the_job(attacked, no_leftovers):
    def attack(a: Attacker) -> None:
        a.set(keys.done(0), "{}")
        a.set(keys.done(1), "{}")

    both = {keys.done(0), keys.done(1)}
    events = _attack(attacked, attack, lambda events: both <= _refused_keys(events))
    assert both <= _refused_keys(events) and not _harm(events), events


def test_3_a_forged_generation_is_not_trained(attacked, no_leftovers, tmp_path):
    forged: list[int] = []

    def attack(a: Attacker) -> None:
        evil = save(dp_plan(1, "bsp", lr=50.0), tmp_path / "evil.yaml")
        generation = int(a.get(keys.GENERATION)) + 5
        a.set(
            keys.generation_document(generation),
            json.dumps({"generation": generation, "members": [0], "plan": str(evil.resolve()), "kind": "scale-in"}),
        )
        a.set(keys.GENERATION, str(generation))
        forged.append(generation)

    def until(events: list[dict]) -> bool:
        refused = _refusal(lambda key: key == keys.generation_document(forged[0]))(events)
        repaired = any(
            e["kind"] == "repaired" and e["key"] == keys.GENERATION for e in events
        )  # the coordinator wrote 0 back
        return refused and repaired

    _attack(attacked, attack, until)
    assert not any(e["kind"] in ("scale-in", "scale-out", "failure") for e in _events(attacked.job, SHARED))


def test_4_a_forged_agent_report_kills_nobody(attacked, no_leftovers):
    def attack(a: Attacker) -> None:
        a.set(
            keys.agent_state(agent),
            json.dumps(
                {
                    "state": "healthy",
                    "workers": {"1": {"pid": 1, "state": "failed", "exit_code": 1, "failure": "pwned"}},
                }
            ),
        )

    agent = next(e for e in _events(attacked.job, SHARED) if e["kind"] == "start")["agents"][0]
    _attack(attacked, attack, _refusal(lambda key: key.startswith("agents/")))
    assert "pwned" not in json.dumps(_events(attacked.job, SHARED))


@pytest.mark.parametrize("tamper", ["delete", "bump"])
def test_5_6_a_deleted_or_bumped_generation_is_written_back_within_the_heartbeat_timeout(
    tamper, attacked, no_leftovers
):
    def attack(a: Attacker) -> None:
        if tamper == "delete":
            a.store.delete_key(a.prefix + keys.GENERATION)
        else:
            a.store.add(a.prefix + keys.GENERATION, 1)

    attacked_at = time.time()
    events = _attack(attacked, attack, lambda events: any(e["kind"] == "repaired" for e in events))
    repaired = [e for e in events if e["kind"] == "repaired"]
    assert repaired[0]["key"] == keys.GENERATION
    assert repaired[0]["time"] - attacked_at < HEARTBEAT_TIMEOUT_S


def test_8_felactl_scale_reports_no_result_the_coordinator_did_not_produce(attacked, no_leftovers):
    """The attacker takes the request off the queue and answers it with a success of its own:
    felactl scale ignores the unsigned answer (recorded), sends its request again, and prints the
    coordinator's own answer."""
    forged: list[str] = []

    def thief(a: Attacker) -> None:
        queue = a.prefix + keys.SCALE_REQUESTS
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if a.store.queue_len(queue) > 0:
                request = json.loads(a.store.queue_pop(queue, block=False))
                request_id = request["body"]["id"]
                a.set(
                    keys.scale_reply(request_id),
                    json.dumps(
                        {
                            "ok": True,
                            "result": {"kind": "scale-out", "members_before": [0, 1], "members_after": [0, 1, 666]},
                        }
                    ),
                )
                forged.append(request_id)
                return
            time.sleep(0.01)

    result = {}

    def attack(a: Attacker) -> None:
        thread = threading.Thread(target=thief, args=(a,), daemon=True)
        thread.start()
        result["scale"] = attacked.job.scale(SHARED, "--to", "2", "--timeout", "30")
        thread.join()
        assert forged, "the attacker never saw the request"

    _attack(attacked, attack, _refusal(lambda key: key == keys.scale_reply(forged[0])))
    scale = result["scale"]
    assert scale.exit_code == 0, scale.output
    out = json.loads(scale.stdout)
    assert out["kind"] == "unchanged" and out["members"] == [0, 1] and "666" not in scale.stdout


@pytest.mark.parametrize("value", ["3", "garbage"])
def test_a_forged_last_step_ends_nobody_early(value, attacked, no_leftovers):
    """``drain/last_step`` is the workers' agreement on a graceful stop's last step: a number put
    there by someone else used to end every worker after that step (or a traceback, for garbage)."""
    events = _attack(attacked, lambda a: a.set(keys.LAST_STEP, value), _refusal(lambda key: key == keys.LAST_STEP))
    assert keys.LAST_STEP in _refused_keys(events) and not _harm(events), events


def test_a_forged_command_to_an_agent_kills_nobody(attacked, no_leftovers):
    """A ``kill`` pushed onto an agent's command queue without the secret (or a genuine one of
    another key) is dropped by the agent and recorded."""
    agent = next(e for e in _events(attacked.job, SHARED) if e["kind"] == "start")["agents"][0]

    def attack(a: Attacker) -> None:
        a.store.queue_push(a.prefix + keys.agent_commands(agent), json.dumps({"op": "kill", "worker_id": 1}))

    events = _attack(attacked, attack, _refusal(lambda key: key.endswith("/commands")))
    assert any(key.endswith("/commands") for key in _refused_keys(events)) and not _harm(events), events


def test_the_attacked_job_ends_as_the_unattacked_run(attacked, unattacked, no_leftovers):
    """After every attack above (run before it, in this file's order): the gate removed, the
    shared job trains its last steps to the unattacked run's steps, final loss and parameters,
    with no failure or change of members on the way and nothing of a forged report in its events."""
    attacked.gate.unlink()
    summary = attacked.job.finish()
    assert _outcome(attacked.job, SHARED, summary) == unattacked
    events = _events(attacked.job, SHARED)
    assert not any(e["kind"] in ("scale-in", "scale-out", "failure") for e in events)
    assert "pwned" not in json.dumps(events)


def _own_job(tmp_path: Path, run: str, attack: Callable[[Attacker, Job], None]) -> tuple[Job, dict]:
    """A gated job of its own, attacked at step :data:`ATTACK_AT`, its gate removed once
    ``attack`` returns; the job and its summary."""
    job = _launch(tmp_path, run, gate=tmp_path / "gate")
    try:
        job.wait_step(run, ATTACK_AT, timeout_s=STARTUP_S)
        attack(Attacker(job, run), job)
        (tmp_path / "gate").unlink()
        summary = job.finish()
    finally:
        job.stop()
    return job, summary


def _await_join(job: Job, run: str, agent: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while not any(e["kind"] == "node-joined" for e in _events(job, run)):
        assert time.monotonic() < deadline and agent.poll() is None, agent.stderr.read().decode()[-2000:]
        time.sleep(0.1)


def _reap(agent: subprocess.Popen | None) -> None:
    """The agent ends with its job; killed if it has not within 20 s."""
    if agent is not None:
        try:
            agent.wait(timeout=20)
        finally:
            agent.kill()
            agent.wait()


def test_7_no_key_locks_a_rightful_agent_out(tmp_path, no_leftovers, unattacked):
    """The old shared ``auth/nonce`` overwritten, a forged join request pushed: a node's agent
    with the right secret still joins the running job (and the forgery is recorded)."""
    agent = None

    def attack(a: Attacker, job: Job) -> None:
        nonlocal agent
        a.set("auth/nonce", "attacker")
        a.store.queue_push(
            a.prefix + keys.JOIN_REQUESTS,
            json.dumps({"agent_id": "evil-1", "client_nonce": "n1", "payload": "{}", "proof": "00" * 32}),
        )
        agent = _start_agent(a, job, "a7", tmp_path, "other")
        _await_join(job, "a7", agent)

    try:
        job, summary = _own_job(tmp_path, "a7", attack)
    finally:
        _reap(agent)
    assert _outcome(job, "a7", summary) == unattacked
    joined = [e for e in _events(job, "a7") if e["kind"] == "node-joined"]
    assert [e["node"] for e in joined] == ["other"]
    assert any(e["key"] == keys.JOIN_REQUESTS for e in _refused(job, "a7"))


def _start_agent(a: Attacker, job: Job, run: str, tmp_path: Path, node: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "felactl",
            "agent",
            "--rdzv-endpoint",
            a.endpoint,
            "--secret-file",
            str(job.root / run / "secret"),
            "--node-name",
            node,
            "--nproc-per-node",
            "1",
            "--log-dir",
            str(tmp_path / f"{node}-logs"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _pose_as_the_coordinator(a: Attacker, refusals: int, timeout_s: float = 30) -> int:
    """Take every join request off the queue before the coordinator (a blocking pop is served
    first), answer each hello with a challenge of the thief's and each join with an unsigned
    ``{"admitted": false}``, until ``refusals`` are forged; then let the coordinator serve.
    Returns the refusals forged."""
    queue = a.prefix + keys.JOIN_REQUESTS
    deadline, forged = time.monotonic() + timeout_s, 0
    host, port = a.endpoint.rsplit(":", 1)
    thief = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    thief.set_timeout(timedelta(seconds=0.2))
    while forged < refusals and time.monotonic() < deadline:
        try:
            request = json.loads(thief.queue_pop(queue, block=True))
        except (RuntimeError, dist.DistStoreError):  # nothing came within the timeout
            continue
        agent, nonce = request["agent_id"], request["client_nonce"]
        if request.get("op") == "hello":
            a.set(keys.join_challenge(agent, nonce), json.dumps({"nonce": "thief"}))
        else:
            a.set(keys.join_reply(agent, nonce), json.dumps({"admitted": False}))
            forged += 1
    return forged


def test_9_an_unsigned_refusal_locks_no_rightful_agent_out(tmp_path, no_leftovers, unattacked):
    """Issue 30 item 2: a store client without the secret takes a joining node's requests and
    answers them with unsigned refusals; the agent, which has the right secret, ignores them (it
    used to exit 2 "wrong job secret") and joins the running job once the thief stops."""
    agent, forged = None, 0

    def attack(a: Attacker, job: Job) -> None:
        nonlocal agent, forged
        agent = _start_agent(a, job, "a9", tmp_path, "other")
        forged = _pose_as_the_coordinator(a, refusals=3)
        _await_join(job, "a9", agent)

    try:
        job, summary = _own_job(tmp_path, "a9", attack)
    finally:
        _reap(agent)
    assert forged >= 3  # as many as used to make the agent give up
    assert _outcome(job, "a9", summary) == unattacked
    assert [e["node"] for e in _events(job, "a9") if e["kind"] == "node-joined"] == ["other"]


def test_a_generation_document_spoiled_during_a_switch_is_written_back(tmp_path):
    """The coordinator alone, on a real store, with its workers played by a thread holding the
    secret: the document of the generation being switched to is overwritten the moment it
    appears. The coordinator writes it back while it waits for the members (it used to check its
    keys only between changes, so the members never saw a valid document and the switch failed)."""
    from felactl.control import Reader
    from felactl.launcher.controlplane import Coordinator, write_secret_file
    from felactl.launcher.rundir import RunDir

    run = RunDir.create("spoil", root=tmp_path)
    plan = dp_plan(2)
    save(plan, run.plan)
    coordinator = Coordinator(write_secret_file(run.secret), job="spoil", events=run.events)
    stop, spoiled = threading.Event(), threading.Event()
    store, name = coordinator.store, keys.generation_document(1)
    try:
        controller = one_node_controller(coordinator, run, plan, 2, heartbeat_timeout_s=2, switch_timeout_s=5)
        workers = Reader(coordinator.seal, store, coordinator.prefix)

        def attacker() -> None:
            while not stop.is_set() and not store.check([coordinator.prefix + name]):
                time.sleep(0.001)
            store.set(coordinator.prefix + name, "garbage")
            spoiled.set()

        def members() -> None:
            n = 0
            while not stop.is_set():
                n += 1
                for w in (0, 1):
                    workers.write(keys.heartbeat(w), "heartbeat", {"n": n, "step": n, "pid": 1})
                if spoiled.is_set():
                    opened = workers.read(name, "generation", generation=1)
                    if opened is not None:
                        for w in opened.body["members"]:
                            workers.write(
                                keys.switched(1, w), "switched", {"report": {"stayed": True, "step": n}}, generation=1
                            )
                time.sleep(0.05)

        threads = [threading.Thread(target=f, daemon=True) for f in (attacker, members)]
        for t in threads:
            t.start()
        event = rescale(controller, {"op": "remove", "ranks": [1]})
    finally:
        stop.set()
        coordinator.close()
    assert event["kind"] == "scale-in" and event["members_after"] == [0]
    assert any(e["kind"] == "refused" and e["key"] == name for e in read_jsonl(run.events))
