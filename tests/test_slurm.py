"""felactl inside Slurm (issue 33), against a real Slurm: ``felactl testbed up --slurm`` runs
munge, slurmctld and a slurmd in each emulated node (Debian's ``slurm-wlm`` and ``munge``; `.ci/run`
installs them where apt can), and a batch job runs felactl there as a user would. Needs root and
the packages; skips with the reason elsewhere. The allocation's reading is also checked without
Slurm, from the environment a job step sees."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from felactl.errors import InputError
from felactl.launcher import slurm
from felactl.launcher.prepare import job_plan
from felactl.spec import load_cluster, save
from felactl.testbed import TestbedUnavailable, down, leftovers, probe_host, up
from felactl.testbed.slurm import client_env, require_slurm
from tests.testbed_fixtures import jobs_alone, pair

ROOT = Path(__file__).resolve().parent.parent
FELACTL = [sys.executable, "-m", "felactl"]
JOB_S = 120.0
"""A two-node job of a few steps takes ~15 s on an idle 2-core machine (agents and workers
importing torch on half a core); this bounds it under a loaded CI machine."""


@pytest.fixture(scope="module")
def cluster():
    """Nodes na (0.9 of a core) and nb (half of the other), each a Slurm node of its own partition."""
    try:
        host = probe_host()
        require_slurm()
    except TestbedUnavailable as exc:
        pytest.skip(str(exc))
    name = f"u{os.getpid() % 1000000}"[:8]
    spec = pair(host, (0.9, 0.5), (0.2, 0.2))
    with jobs_alone():
        state = up(spec, "pair.yaml", name=name, host=host, allow_no_latency=True, slurm=True)
        try:
            yield state
        finally:
            down(name)
            assert not leftovers(name)


def _sbatch(state, tmp_path: Path, *lines: str, header: tuple[str, ...] = ("#SBATCH --nodes=2",)) -> str:
    """Submit a batch script of ``lines`` (felactl as this checkout runs it), its ``#SBATCH``
    lines ``header``; its job id."""
    script = tmp_path / "job.sh"
    script.write_text(
        "\n".join(
            [
                "#!/bin/sh",
                f"#SBATCH --output={tmp_path}/out-%j.txt",
                *header,
                f"cd {tmp_path}",
                f"export OMP_NUM_THREADS=1 PYTHONPATH={ROOT}",
                f"FELACTL='{sys.executable} -m felactl'",
                *lines,
            ]
        )
        + "\n"
    )
    done = subprocess.run(
        ["sbatch", "--parsable", str(script)], env=client_env(state.name), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _said(output: Path, state) -> str:
    """A failed job's output and the end of Slurm's logs: what a failure's report needs."""
    where = Path(state.slurm_conf).parent
    logs = [output, where / "slurmctld.log", *sorted(where.glob("slurmd-*.log"))]
    return "\n".join(f"--- {log}\n" + "\n".join(log.read_text().splitlines()[-25:]) for log in logs if log.exists())


def _wait_for(condition, output: Path) -> None:
    """Until ``condition()`` holds (a job's progress); else fail, showing the job's ``output``."""
    deadline = time.monotonic() + JOB_S
    while not condition():
        assert time.monotonic() < deadline, output.read_text() if output.exists() else f"no {output}"
        time.sleep(0.2)


def _job_fields(state, job_id: str) -> dict[str, str]:
    shown = subprocess.run(
        ["scontrol", "show", "job", job_id], env=client_env(state.name), capture_output=True, text=True, timeout=30
    ).stdout
    return dict(w.split("=", 1) for w in shown.split() if "=" in w)


def _job_state(state, job_id: str) -> str:
    return _job_fields(state, job_id).get("JobState", "")


def _wait_job(state, job_id: str, restarts: int = 0) -> str:
    """Wait for the job (its ``restarts``-th requeued run) to end; its final state (COMPLETED,
    FAILED, ...). A job just requeued still shows its last run's end for a moment."""
    deadline = time.monotonic() + JOB_S
    while time.monotonic() < deadline:
        fields = _job_fields(state, job_id)
        job_state = fields.get("JobState", "")
        done = job_state and job_state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED")
        if done and int(fields.get("Restarts", "0")) >= restarts:
            return job_state
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=client_env(state.name), timeout=30)
    pytest.fail(f"Slurm job {job_id} did not end in {JOB_S:g} s")


@pytest.mark.multiprocess
def test_the_testbed_is_a_slurm_cluster_with_a_partition_per_cpu_share(cluster):
    shown = subprocess.run(
        ["sinfo", "--noheader", "--format=%P %D %t %N"], env=client_env(cluster.name), capture_output=True, text=True
    ).stdout.split("\n")
    partitions = {line.split()[0]: line.split()[1:] for line in shown if line.strip()}
    assert partitions == {"all*": ["2", "idle", "na,nb"], "cpu90": ["1", "idle", "na"], "cpu50": ["1", "idle", "nb"]}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_heterogeneous_job_is_one_cluster_of_both_kinds_and_trains_on_both(cluster, tmp_path):
    """A hetjob of a node of partition cpu90 and one of cpu50 (as a cluster's partitions of two
    GPU types): ``felactl profile`` inside it measures both components as one cluster, each node
    its own kind, with the links between them; ``felactl launch`` runs a step in each component,
    for a ``--job`` and for a torchrun-style ``--script``; a plan of a node the allocation lacks is
    refused in one line."""
    elsewhere = job_plan("examples.cnn:job", {}, 1, 16, None, nodes=("na", "nc"))
    save(elsewhere, tmp_path / "elsewhere.yaml")
    job = _sbatch(
        cluster,
        tmp_path,
        "$FELACTL launch elsewhere.yaml --steps 2 2> refused.txt; echo $? > refused.rc",
        "$FELACTL profile --nproc-per-node 1 --repetitions 2 --message-bytes 1000000 --matmul-size 128 "
        "-o cluster.yaml > /dev/null",
        "$FELACTL launch --job examples.cnn:job --nproc-per-node 1 --global-batch 16 --steps 2 --json > summary.json",
        f"$FELACTL launch --script {ROOT}/tests/_torchrun_script.py --nproc-per-node 1 --json > script.json -- "
        "--steps 3",
        header=("#SBATCH --partition=cpu90 --nodes=1", "#SBATCH hetjob", "#SBATCH --partition=cpu50 --nodes=1"),
    )
    assert _wait_job(cluster, job) == "COMPLETED", (tmp_path / f"out-{job}.txt").read_text()
    # a plan of a node the allocation lacks: refused before anything starts, saying which
    assert (tmp_path / "refused.rc").read_text().strip() == "2"
    assert (tmp_path / "refused.txt").read_text().strip().splitlines() == [
        f"felactl: error: elsewhere.yaml: placement: node 'nc' is not in Slurm job {job} (2 node(s): na, nb); plan "
        "for a cluster profiled with `felactl profile` inside this allocation, or ask Slurm for those nodes "
        "(sbatch --nodelist)"
    ]
    profiled = load_cluster(tmp_path / "cluster.yaml")
    assert profiled.name == f"felactl-{cluster.name}"  # Slurm's cluster name
    by_node = {d.name: d.model for d in profiled.devices}
    assert set(by_node) == {"na-cpu0", "nb-cpu0"}
    assert by_node["na-cpu0"].endswith("@ 0.9 cores") and by_node["nb-cpu0"].endswith("@ 0.5 cores")
    assert {(link.src, link.dst) for link in profiled.links} == {("na-cpu0", "nb-cpu0"), ("nb-cpu0", "na-cpu0")}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["workers"]) == 2
    script = json.loads((tmp_path / "script.json").read_text())  # a torchrun-style script, a rank per node
    assert script["exit_code"] == 0 and script["num_workers"] == 2


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_job_slurm_stops_checkpoints_and_resumes_where_it_stopped_when_requeued(cluster, tmp_path):
    """Preemption as Slurm does it: SIGTERM to the batch script and every step (``scancel
    --signal=TERM --full``); the launch drains, every worker checkpoints the step they agree on;
    ``scontrol requeue`` starts the job again (``SLURM_RESTART_COUNT`` 1), here on the other node,
    and the run, named after the job, resumes from that checkpoint there and completes every step:
    no completed step is lost."""
    job = _sbatch(
        cluster,
        tmp_path,
        "exec $FELACTL launch --job examples.cnn:job --nproc-per-node 1 --global-batch 16 --steps 600 "
        "--checkpoint-every 50 --json > summary.json",
        header=("#SBATCH --nodes=1 --nodelist=na --requeue --open-mode=append",),
    )
    run = tmp_path / "runs" / f"slurm-{job}"
    _wait_for(lambda: (run / "checkpoints" / "step000050").is_dir(), tmp_path / f"out-{job}.txt")
    _slurm(cluster, "scancel", "--signal=TERM", "--full", job)
    _wait_job(cluster, job)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    (stopped,) = [e for e in events if e["kind"] == "stopped"]
    assert stopped["checkpoint_step"] >= 50 and not (tmp_path / "summary.json").read_text().strip()
    # as Slurm requeues a preempted job: once its nodes are free again (its steps' clean-up done)
    _wait_for(lambda: _node_state(cluster, "na") == "idle", tmp_path / f"out-{job}.txt")
    _slurm(cluster, "scontrol", "requeue", job)  # it starts once its last run's credential expires (10 s here)
    _slurm(cluster, "scontrol", "update", f"JobId={job}", "ReqNodeList=nb")  # na is gone, say
    assert _wait_job(cluster, job, restarts=1) == "COMPLETED", _said(tmp_path / f"out-{job}.txt", cluster)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    (resumed,) = [e for e in events if e["kind"] == "resume"]
    assert resumed["from_step"] == stopped["checkpoint_step"]
    assert [e["members"] for e in events if e["kind"] == "start"] == [["na"], ["nb"]]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"] == f"slurm-{job}" and summary["steps"] == 600
    assert "Slurm requeued job" in (tmp_path / f"out-{job}.txt").read_text()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_scale_asks_slurm_for_a_node_that_joins_the_running_job_and_gives_it_back(cluster, tmp_path):
    """A job on na alone; ``felactl scale --slurm-nodes 1`` (from outside the job, as from a login
    node) submits a batch job of an agent, which Slurm runs on nb; it joins and a worker starts
    there (a live scale-out, replicas equal); ``--remove`` of that worker cancels nb's Slurm job."""
    job = _sbatch(
        cluster,
        tmp_path,
        "exec $FELACTL launch --job examples.cnn:job --nproc-per-node 1 --global-batch 16 --steps 100000 "
        "--slowdown 0=3 --json > summary.json",
        header=("#SBATCH --nodes=1 --nodelist=na",),
    )
    run = tmp_path / "runs" / f"slurm-{job}"
    _wait_for(lambda: (run / "metrics.jsonl").exists(), tmp_path / f"out-{job}.txt")
    scale = [*FELACTL, "scale", f"slurm-{job}", "--runs-root", str(tmp_path / "runs"), "--json"]
    env = {**client_env(cluster.name), "PYTHONPATH": str(ROOT)}
    try:
        grown = subprocess.run(
            [*scale, "--slurm-nodes", "1", "--sbatch-arg=--nodelist=nb"], env=env, capture_output=True, text=True
        )
        assert grown.returncode == 0, grown.stderr
        out = json.loads(grown.stdout)
        assert out["kind"] == "scale-out" and out["members_after"] == [0, 1] and out["nodes"] == ["nb"]
        checksums = {s["param_checksum"] for s in out["switch_s"].values()}
        assert len(checksums) == 1  # the newcomer starts from the running replica's weights
        assert _job_state(cluster, out["slurm_job"]) == "RUNNING"
        shrunk = subprocess.run([*scale, "--remove", "1"], env=env, capture_output=True, text=True)
        assert shrunk.returncode == 0, shrunk.stderr
        assert json.loads(shrunk.stdout)["slurm_released"] == [out["slurm_job"]]
        assert _wait_job(cluster, out["slurm_job"]) == "CANCELLED"
    finally:
        _slurm(cluster, "scancel", "--signal=TERM", "--full", job)  # drains the launch: the test is over
    _wait_job(cluster, job)
    kinds = [json.loads(line)["kind"] for line in (run / "events.jsonl").read_text().splitlines()]
    assert "slurm-nodes" in kinds and "slurm-released" in kinds and kinds[-1] == "stopped"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_scale_inside_the_allocation_starts_an_agent_on_a_node_the_plan_left_spare(cluster, tmp_path):
    """A two-node allocation whose plan runs on na alone; ``felactl scale --add 1 --node nb`` run
    inside the allocation (a job step, as from salloc's shell) starts an agent on nb as a step of
    the job, the run's secret on its stdin, and a worker there joins the running job."""
    save(job_plan("examples.cnn:job", {}, 1, 16, None, nodes=("na",)), tmp_path / "na.yaml")
    job = _sbatch(
        cluster,
        tmp_path,
        "exec $FELACTL launch na.yaml --steps 100000 --slowdown 0=3 --json > summary.json",
        header=("#SBATCH --nodes=2",),
    )
    run = tmp_path / "runs" / f"slurm-{job}"
    _wait_for(lambda: (run / "metrics.jsonl").exists(), tmp_path / f"out-{job}.txt")
    scale = [*FELACTL, "scale", f"slurm-{job}", "--runs-root", str(tmp_path / "runs"), "--json"]
    step = ["srun", f"--jobid={job}", "--overlap", "--nodes=1", "--nodelist=na", "--chdir", str(tmp_path)]
    env = {**client_env(cluster.name), "PYTHONPATH": str(ROOT)}
    try:
        grown = subprocess.run([*step, *scale, "--add", "1", "--node", "nb"], env=env, capture_output=True, text=True)
        assert grown.returncode == 0, grown.stderr + _said(tmp_path / f"out-{job}.txt", cluster)
        out = json.loads(grown.stdout)
        assert out["kind"] == "scale-out" and out["members_after"] == [0, 1]
        assert len({s["param_checksum"] for s in out["switch_s"].values()}) == 1
    finally:
        _slurm(cluster, "scancel", "--signal=TERM", "--full", job)  # drains the launch: the test is over
    _wait_job(cluster, job)
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["node"] for e in events if e["kind"] == "node-joined"] == ["nb"]
    assert sorted(p.name for p in (run / "logs").glob("slurm-*.log")) == ["slurm-na.log", "slurm-nb.log"]
    assert events[-1]["kind"] == "stopped"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_batch_job_trains_on_both_nodes_and_survives_one_that_slurm_loses(cluster, tmp_path):
    """``sbatch -N 2`` of ``felactl launch --job``: one agent per node as a job step, each in its
    node (the workers' gloo crosses the emulated link), the coordinator on the batch node's
    address. Then nb loses power mid-run (every process there killed: its slurmd, the step's
    slurmstepd, its agent and worker): Slurm marks it down, the job (``--no-kill``) is not ended
    for it, and the elastic launch drops nb's worker and completes every step on na, none lost.
    (Last of the module: nb stays down.)"""
    from felactl.testbed.faults import crash_node

    job = _sbatch(
        cluster,
        tmp_path,
        # every step at least 25 ms (each worker sleeps that long in every iteration): 800 steps
        # outlast the ~10 s Slurm takes to mark nb down on any CPU (a rank slowed 3x by compute
        # finished 1200 steps in 20 s on a fast one, before the check that the job still ran)
        "exec $FELACTL launch --job examples.cnn:job --nproc-per-node 1 --global-batch 16 --steps 800 --json "
        "--heartbeat-timeout 3 --collective-timeout 5 --straggler prob:1:0.025 > summary.json",
        header=("#SBATCH --nodes=2 --no-kill",),
    )
    run = tmp_path / "runs" / f"slurm-{job}"
    metrics = run / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") > 20, tmp_path / f"out-{job}.txt")
    assert crash_node(cluster.name, "nb")
    _wait_for(lambda: "down" in _node_state(cluster, "nb"), tmp_path / f"out-{job}.txt")
    assert _job_state(cluster, job) == "RUNNING", (  # not ended for one node
        (tmp_path / f"out-{job}.txt").read_text() + (tmp_path / "summary.json").read_text()
    )
    assert _wait_job(cluster, job) == "COMPLETED", (tmp_path / f"out-{job}.txt").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 800 and len(summary["workers"]) == 2
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    (start,) = [e for e in events if e["kind"] == "start"]
    assert sorted(start["members"]) == ["na", "nb"]
    (launched,) = [e for e in events if e["kind"] == "launch"]
    assert launched["endpoint"].startswith(cluster.nodes["na"].address + ":")  # the batch node's address
    assert sorted(p.name for p in (run / "logs").glob("slurm-*.log")) == ["slurm-na.log", "slurm-nb.log"]
    assert [e["members_after"] for e in events if e["kind"] == "failure"] == [[0]]


def _node_state(state, node: str) -> str:
    """``node``'s state in Slurm (``idle``, ``alloc``, ``down*`` ...; sinfo lists it once per partition)."""
    shown = subprocess.run(
        ["sinfo", "--noheader", "--Node", f"--nodes={node}", "--format=%t"],
        env=client_env(state.name),
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.split()
    return shown[0] if shown else ""


def _slurm(state, *argv: str) -> None:
    done = subprocess.run(argv, env=client_env(state.name), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


# --- the allocation, read from a job step's environment ------------------------------------------


def test_an_allocation_is_read_from_the_environment_and_a_plan_outside_it_is_refused(monkeypatch):
    expanded = {"n[1-2]": ["n1", "n2"], "a10g[3-4]": ["a10g3", "a10g4"], "h100x": ["h100x"]}
    monkeypatch.setattr(slurm, "hostnames", lambda nodelist: expanded[nodelist])
    assert slurm.current_allocation({}) is None
    plain = slurm.current_allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n1"})
    assert plain.nodes == ("n1", "n2") and plain.this_node == "n1" and set(plain.components.values()) == {0}
    # a step srun started from outside the job (-w n1): Slurm sets SLURM_JOB_NODELIST to the step's nodes
    step = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "h100x", "SLURM_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0"}
    assert slurm.current_allocation(step).nodes == ("n1", "n2")
    het = slurm.current_allocation(
        {
            "SLURM_JOB_ID": "8",
            "SLURM_JOB_NODELIST": "a10g[3-4],h100x",
            "SLURM_JOB_NODELIST_HET_GROUP_0": "h100x",
            "SLURM_JOB_NODELIST_HET_GROUP_1": "a10g[3-4]",
        }
    )
    assert het.nodes == ("h100x", "a10g3", "a10g4") and dict(het.components) == {"h100x": 0, "a10g3": 1, "a10g4": 1}
    with pytest.raises(
        InputError, match=r"plan.yaml: placement: node 'n3' is not in Slurm job 7 \(2 node\(s\): n1, n2\)"
    ):
        plain.check_holds({"n1": (), "n3": ()}, "plan.yaml")
    with pytest.raises(InputError, match="SLURMD_NODENAME is not set; run felactl inside the batch script"):
        het.coordinator_endpoint()


def test_an_agent_step_per_node_gets_the_secret_on_its_stdin_never_on_a_command_line(monkeypatch, tmp_path):
    """``start_step_agents`` as it runs: one srun step per node (in its heterogeneous component),
    each handed the secret on stdin; no argv holds it."""
    started = []

    class FakeStep:
        def __init__(self, argv, **kwargs):
            self.argv, self.stdin, self.written = argv, self, b""
            started.append(self)

        def write(self, data):
            self.written += data

        def close(self):
            pass

    monkeypatch.setattr("felactl.agents.agent.subprocess.Popen", FakeStep)
    monkeypatch.setattr(slurm.shutil, "which", lambda tool: f"/usr/bin/{tool}")  # runs without Slurm too
    het = slurm.Allocation(job_id="9", nodes=("h1", "a1"), this_node="h1", components={"h1": 0, "a1": 1})
    secret = "s3cret-of-the-job"
    slurm.start_step_agents(het, {"h1": 2, "a1": None}, "10.0.0.1:1234", secret, tmp_path, "run9")
    assert [step.argv[:4] for step in started] == [
        ["srun", "--jobid=9", "--het-group=0", "--overlap"],
        ["srun", "--jobid=9", "--het-group=1", "--overlap"],
    ]
    assert ["--nodelist=h1", "--nodelist=a1"] == [
        next(a for a in s.argv if a.startswith("--nodelist")) for s in started
    ]
    assert "--nproc-per-node" in started[0].argv and "--nproc-per-node" not in started[1].argv  # a1: its own GPUs
    for step in started:
        assert step.written == (secret + "\n").encode() and not any(secret in arg for arg in step.argv)
        assert step.argv[step.argv.index("--secret-file") + 1] == "-"


def test_a_run_is_named_after_its_job_and_a_requeued_job_resumes_it_or_starts_again(tmp_path):
    first = slurm.Allocation(job_id="42", nodes=("n1",), this_node="n1", components={"n1": 0})
    assert slurm.requeued_run(first, None, tmp_path) == ("slurm-42", None)
    assert slurm.requeued_run(first, "mine", tmp_path) == ("mine", None)
    again = dataclasses.replace(first, restart_count=1)
    assert slurm.requeued_run(again, None, tmp_path) == ("slurm-42", None)  # nothing ran before: a new run
    (tmp_path / "slurm-42" / "checkpoints").mkdir(parents=True)
    assert slurm.requeued_run(again, None, tmp_path) == ("slurm-42-r1", None)  # no checkpoint to resume from


def test_growing_through_slurm_takes_only_its_own_agents_and_gives_up_when_its_job_ends(monkeypatch, tmp_path):
    """``scale --slurm-nodes``' waits, without Slurm: a job Slurm ends before it runs, or whose
    agents never join, is one line (and cancelled by the caller); an agent's join recorded before
    the request does not count as the new node's."""
    from felactl.launcher import slurm_scale
    from felactl.launcher.rundir import RunDir

    states = iter([("PENDING", ""), ("BOOT_FAIL", "")])
    monkeypatch.setattr(slurm_scale, "_job", lambda job_id: next(states))
    monkeypatch.setattr(slurm_scale, "POLL_S", 0.0)
    with pytest.raises(
        InputError, match=r"Slurm job 5 for the new nodes ended before it ran \(BOOT_FAIL\); nothing changed"
    ):
        slurm_scale._wait_granted("5", time.monotonic() + 60)

    run = RunDir.create("r", root=tmp_path)
    joined = {"kind": "node-joined", "node": "nb"}
    run.events.write_text(json.dumps(joined) + "\n")  # nb's agent of an earlier grow
    monkeypatch.setattr(slurm_scale, "_job", lambda job_id: ("RUNNING", "nb") if not ended else ("", ""))
    ended = False
    job_ended = functools.partial(slurm_scale._job_ended, "6")
    with pytest.raises(InputError, match="the agents on nb did not join: in time"):
        slurm_scale._wait_joined(run, ["nb"], 1, time.monotonic() + 0.3, job_ended, "the log")
    ended = True
    with pytest.raises(InputError, match=r"their Slurm job 6 ended \(gone\) \(see the log\); nothing changed"):
        slurm_scale._wait_joined(run, ["nb"], 1, time.monotonic() + 60, job_ended, "the log")
    with run.events.open("a") as events:
        events.write(json.dumps(joined) + "\n")
    slurm_scale._wait_joined(run, ["nb"], 1, time.monotonic() + 60, job_ended, "the log")  # its own join: done


def test_a_job_requeued_onto_other_nodes_moves_the_workers_of_the_nodes_it_lost_there(caplog):
    from felactl.spec import Placement

    plan = job_plan("examples.cnn:job", {}, 1, 16, None, nodes=("n1", "n2"))
    again = slurm.Allocation(job_id="9", nodes=("n2", "n7"), this_node="n2", components={"n2": 0, "n7": 0})
    moved = slurm.requeued_onto(again, plan)
    assert [p.node for p in moved.placement] == ["n7", "n2"]  # n2 kept its worker, n1's went to n7
    assert "Slurm requeued job 9 onto other nodes: its workers on n1 run on n7" in caplog.text
    assert moved.devices == plan.devices and isinstance(moved.placement[0], Placement)
    fewer = dataclasses.replace(again, nodes=("n2",), components={"n2": 0})
    assert slurm.requeued_onto(fewer, plan) is plan  # refused by check_holds, naming n1
    het = dataclasses.replace(again, components={"n2": 0, "n7": 1})
    assert slurm.requeued_onto(het, plan) is plan


def test_a_second_requeue_resumes_the_run_the_first_one_started_again(monkeypatch, tmp_path):
    """Restart 1 found no checkpoint and started ``slurm-42-r1``, which checkpointed; restart 2
    resumes that one (it started ``slurm-42-r2`` from nothing, losing r1's steps)."""
    from felactl.launcher import resume
    from felactl.launcher.rundir import RunDir

    for run in ("slurm-42", "slurm-42-r1"):
        (RunDir.create(run, root=tmp_path).path / "launch.json").write_text("{}")

    def newest(rundir):
        if rundir.run_id != "slurm-42-r1":
            raise InputError(f"run {rundir.run_id} has no complete checkpoint")

    monkeypatch.setattr(resume, "pick_checkpoint", newest)
    second = slurm.Allocation(job_id="42", nodes=("n1",), this_node="n1", components={"n1": 0}, restart_count=2)
    assert slurm.requeued_run(second, None, tmp_path) == ("slurm-42-r1", "slurm-42-r1")


def test_a_shrink_that_empties_the_nodes_slurm_granted_gives_them_back(monkeypatch, tmp_path):
    """``felactl scale --to 1`` (as ``--remove``) leaving no worker on the nodes of a Slurm job
    ``--slurm-nodes`` got: that job is cancelled, once, and the run records it."""
    from typer.testing import CliRunner

    from felactl.cli.main import app
    from felactl.launcher import slurm_scale
    from felactl.launcher.rundir import RunDir

    run = RunDir.create("r", root=tmp_path)
    (run.path / "launch.json").write_text("{}")
    run.events.write_text(json.dumps({"kind": "slurm-nodes", "job": "77", "nodes": ["nb"], "workers": [1]}) + "\n")
    cancelled = []
    monkeypatch.setattr(slurm_scale, "request_scale", lambda *a, **k: {"kind": "scale-in", "members_after": [0]})
    monkeypatch.setattr(slurm_scale, "run_slurm", lambda *argv: cancelled.append(argv) or "")
    for _ in range(2):
        done = CliRunner().invoke(app, ["scale", "r", "--to", "1", "--runs-root", str(tmp_path), "--json"])
        assert done.exit_code == 0, done.output
    assert cancelled == [("scancel", "77")]
    assert [e["kind"] for e in map(json.loads, run.events.read_text().splitlines())] == [
        "slurm-nodes",
        "slurm-released",
    ]


def test_scale_refuses_a_flag_of_the_other_kind_in_one_line():
    from typer.testing import CliRunner

    from felactl.cli.main import app

    for argv, said in (
        (["--add", "1", "--sbatch-arg=--partition=a"], "--sbatch-arg: only with --slurm-nodes"),
        (["--slurm-nodes", "1", "--node", "n2"], "--node: not with --slurm-nodes"),
    ):
        done = CliRunner().invoke(app, ["scale", "r", *argv])
        assert done.exit_code == 2 and said in done.output, done.output


def test_testbed_down_finds_its_slurm_daemons_by_their_directory_and_no_other_testbeds(tmp_path):
    """By command line, even without a state file: ``/x/a-slurm`` is not ``/x/a-slurm-slurm``."""
    from felactl.testbed.slurm import _daemons_of

    ours, theirs = tmp_path / "a-slurm", tmp_path / "a-slurm-slurm"
    sleepers = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--conf={where}/slurm.conf"])
        for where in (ours, theirs)
    ]
    try:
        assert _daemons_of(ours) == [sleepers[0].pid]
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


def test_an_agent_scale_started_on_a_spare_node_goes_when_the_request_after_it_fails(monkeypatch, tmp_path):
    """``scale --add 1 --node nb`` inside an allocation: nb had no agent, scale started one; the
    request then refused anyway: nothing changed, so the agent's step is stopped too."""
    from felactl.launcher import slurm_scale

    class Step:
        stopped = False

    step = Step()
    refusals = iter(["refused: --node 'nb': no agent of this job runs there", "refused: the job is finishing"])

    def refuse(*args, **kwargs):
        raise InputError(next(refusals))

    monkeypatch.setattr(slurm_scale, "request_scale", refuse)
    monkeypatch.setattr(slurm_scale, "_start_allocation_agent", lambda *args: step)
    monkeypatch.setattr(slurm_scale, "stop_processes", lambda procs: setattr(procs[0], "stopped", True))
    with pytest.raises(InputError, match="the job is finishing"):
        slurm_scale.rescale(
            "r", {"op": "add", "count": 1, "node": "nb"}, runs_root=tmp_path, secret_file=None, timeout_s=5
        )
    assert step.stopped
