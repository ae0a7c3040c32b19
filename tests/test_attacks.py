"""Issue 13's eight attacks on a running job's control plane, by a local process without the
secret (a plain TCPStore client on loopback): each is ignored and recorded, or noticed and
repaired, and the job trains every step to the result of an unattacked run."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from felactl.control import keys
from felactl.launcher.rundir import read_jsonl
from felactl.spec import save

sys.path.insert(0, str(Path(__file__).parent))
from _worker_helpers import Job, dp_plan, one_node_controller, rescale  # noqa: E402

pytestmark = pytest.mark.multiprocess
STEPS = 200
ATTACK_AT = 30
HEARTBEAT_TIMEOUT_S = 5.0
# A fixed sleep per step (one worker per step, in turn) keeps the job running ~7 s on any machine
# without changing what it computes.
ARGS = ("--steps", str(STEPS), "--max-nproc-per-node", "2")
STRAGGLER_S = 0.03


def _launch(tmp_path: Path, run: str, straggler_s: float = STRAGGLER_S) -> Job:
    """The job attacked; a longer ``straggler_s`` makes it outlive a longer attack, computing
    the same (the sleep changes no number)."""
    plan = save(dp_plan(2, "bsp"), tmp_path / "plan.yaml")
    return Job(tmp_path, str(plan), "--run-id", run, *ARGS, "--straggler", f"roundrobin:{straggler_s}")


def _outcome(job: Job, run: str, summary: dict) -> tuple:
    """What must equal an unattacked run's: every step, the final loss, the parameters."""
    checksums = [
        json.loads((job.root / run / "workers" / f"rank{w}.json").read_text())["param_checksum"] for w in (0, 1)
    ]
    return summary["steps"], round(summary["final_loss"], 6), tuple(round(c, 5) for c in checksums)


@pytest.fixture(scope="module")
def unattacked(tmp_path_factory) -> tuple:
    tmp_path = tmp_path_factory.mktemp("unattacked")
    job = _launch(tmp_path, "u")
    try:
        summary = job.finish()
    finally:
        job.stop()
    return _outcome(job, "u", summary)


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


def _attack(tmp_path: Path, run: str, attack, straggler_s: float = STRAGGLER_S) -> tuple[Job, dict, float]:
    job = _launch(tmp_path, run, straggler_s)
    try:
        job.wait_step(run, ATTACK_AT)
        attacked_at = time.time()
        attack(Attacker(job, run), job)
        summary = job.finish()
    finally:
        job.stop()
    return job, summary, attacked_at


def test_1_a_forged_stop_is_ignored_and_recorded(tmp_path, no_leftovers, unattacked):
    job, summary, _ = _attack(tmp_path, "a1", lambda a, job: a.set(keys.STOP, "garbage"))
    assert _outcome(job, "a1", summary) == unattacked
    assert any(e["key"] == keys.STOP for e in _refused(job, "a1"))


def test_2_forged_done_marks_do_not_finish_the_job(tmp_path, no_leftovers, unattacked):
    def attack(a: Attacker, job: Job) -> None:
        a.set(keys.done(0), "{}")
        a.set(keys.done(1), "{}")

    job, summary, _ = _attack(tmp_path, "a2", attack)
    assert _outcome(job, "a2", summary) == unattacked
    assert {keys.done(0), keys.done(1)} <= {e["key"] for e in _refused(job, "a2")}


def test_3_a_forged_generation_is_not_trained(tmp_path, no_leftovers, unattacked):
    def attack(a: Attacker, job: Job) -> None:
        evil = save(dp_plan(1, "bsp", lr=50.0), tmp_path / "evil.yaml")
        generation = int(a.get(keys.GENERATION)) + 5
        a.set(
            keys.generation_document(generation),
            json.dumps({"generation": generation, "members": [0], "plan": str(evil.resolve()), "kind": "scale-in"}),
        )
        a.set(keys.GENERATION, str(generation))

    job, summary, _ = _attack(tmp_path, "a3", attack)
    assert _outcome(job, "a3", summary) == unattacked
    events = _events(job, "a3")
    assert any(e["key"] == keys.generation_document(5) for e in _refused(job, "a3"))  # the workers refused it
    assert any(e["kind"] == "repaired" and e["key"] == keys.GENERATION for e in events)  # the coordinator wrote 0 back
    assert not any(e["kind"] in ("scale-in", "scale-out", "failure") for e in events)


def test_4_a_forged_agent_report_kills_nobody(tmp_path, no_leftovers, unattacked):
    def attack(a: Attacker, job: Job) -> None:
        agent = next(e for e in _events(job, "a4") if e["kind"] == "start")["agents"][0]
        a.set(
            keys.agent_state(agent),
            json.dumps(
                {
                    "state": "healthy",
                    "workers": {"1": {"pid": 1, "state": "failed", "exit_code": 1, "failure": "pwned"}},
                }
            ),
        )

    job, summary, _ = _attack(tmp_path, "a4", attack)
    assert _outcome(job, "a4", summary) == unattacked
    assert any(e["key"].startswith("agents/") for e in _refused(job, "a4"))
    assert not any(e["kind"] == "failure" for e in _events(job, "a4"))
    assert "pwned" not in json.dumps(_events(job, "a4"))


@pytest.mark.parametrize("tamper", ["delete", "bump"])
def test_5_6_a_deleted_or_bumped_generation_is_written_back_within_the_heartbeat_timeout(
    tamper, tmp_path, no_leftovers, unattacked
):
    def attack(a: Attacker, job: Job) -> None:
        if tamper == "delete":
            a.store.delete_key(a.prefix + keys.GENERATION)
        else:
            a.store.add(a.prefix + keys.GENERATION, 1)

    run = f"a5{tamper}"
    job, summary, attacked_at = _attack(tmp_path, run, attack)
    assert _outcome(job, run, summary) == unattacked
    repaired = [e for e in _events(job, run) if e["kind"] == "repaired"]
    assert repaired and repaired[0]["key"] == keys.GENERATION
    assert repaired[0]["time"] - attacked_at < HEARTBEAT_TIMEOUT_S
    assert not any(e["kind"] == "failure" for e in _events(job, run))


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
        deadline = time.monotonic() + 20
        while not any(e["kind"] == "node-joined" for e in _events(job, "a7")):
            assert time.monotonic() < deadline and agent.poll() is None, agent.stderr.read().decode()[-2000:]
            time.sleep(0.1)

    try:
        job, summary, _ = _attack(tmp_path, "a7", attack)
    finally:
        if agent is not None:
            try:
                agent.wait(timeout=20)
            finally:
                agent.kill()
                agent.wait()
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
        deadline = time.monotonic() + 20
        while not any(e["kind"] == "node-joined" for e in _events(job, "a9")):
            assert time.monotonic() < deadline and agent.poll() is None, agent.stderr.read().decode()[-2000:]
            time.sleep(0.1)

    try:
        job, summary, _ = _attack(tmp_path, "a9", attack, straggler_s=0.12)  # ~20 s of steps
    finally:
        if agent is not None:
            try:
                agent.wait(timeout=20)
            finally:
                agent.kill()
                agent.wait()
    assert forged >= 3  # as many as used to make the agent give up
    assert _outcome(job, "a9", summary) == unattacked
    assert [e["node"] for e in _events(job, "a9") if e["kind"] == "node-joined"] == ["other"]


def test_8_felactl_scale_reports_no_result_the_coordinator_did_not_produce(tmp_path, no_leftovers, unattacked):
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

    def attack(a: Attacker, job: Job) -> None:
        thread = threading.Thread(target=thief, args=(a,), daemon=True)
        thread.start()
        result["scale"] = job.scale("a8", "--to", "2", "--timeout", "30")
        thread.join()

    job, summary, _ = _attack(tmp_path, "a8", attack)
    assert forged, "the attacker never saw the request"
    scale = result["scale"]
    assert scale.exit_code == 0, scale.output
    out = json.loads(scale.stdout)
    assert out["kind"] == "unchanged" and out["members"] == [0, 1] and "666" not in scale.stdout
    assert any(e["key"] == keys.scale_reply(forged[0]) for e in _refused(job, "a8"))
    assert _outcome(job, "a8", summary) == unattacked


@pytest.mark.parametrize("value", ["3", "garbage"])
def test_a_forged_last_step_ends_nobody_early(value, tmp_path, no_leftovers, unattacked):
    """``drain/last_step`` is the workers' agreement on a graceful stop's last step: a number put
    there by someone else used to end every worker after that step (or a traceback, for garbage)."""
    run = f"d{value[0]}"
    job, summary, _ = _attack(tmp_path, run, lambda a, job: a.set(keys.LAST_STEP, value))
    assert _outcome(job, run, summary) == unattacked
    assert any(e["key"] == keys.LAST_STEP for e in _refused(job, run))


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


def test_a_forged_command_to_an_agent_kills_nobody(tmp_path, no_leftovers, unattacked):
    """A ``kill`` pushed onto an agent's command queue without the secret (or a genuine one of
    another key) is dropped by the agent and recorded."""

    def attack(a: Attacker, job: Job) -> None:
        agent = next(e for e in _events(job, "c") if e["kind"] == "start")["agents"][0]
        a.store.queue_push(a.prefix + keys.agent_commands(agent), json.dumps({"op": "kill", "worker_id": 1}))

    job, summary, _ = _attack(tmp_path, "c", attack)
    assert _outcome(job, "c", summary) == unattacked
    assert any(e["key"].endswith("/commands") for e in _refused(job, "c"))
