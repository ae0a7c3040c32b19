"""Jobs inside a testbed: ``felactl profile --testbed`` and ``felactl launch --testbed`` run each
node's agent in its namespace and cgroup (gloo on its ``fl0``), the coordinator on the bridge.
Needs root; skips with the reason elsewhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from felactl.spec.io import from_dict
from felactl.testbed import TestbedSpec, TestbedUnavailable, down, probe_host, up
from felactl.testbed.shaping import set_link

ROOT = Path(__file__).resolve().parent.parent
FELACTL = [sys.executable, "-m", "felactl"]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    "OMP_NUM_THREADS": "1",
}
MLP = {"name": "mlp", "source": "mlp", "config": {"input_dim": 256, "hidden": 512, "depth": 4, "num_classes": 10}}


@pytest.fixture(scope="module")
def host():
    try:
        return probe_host()
    except TestbedUnavailable as exc:
        pytest.skip(str(exc))


def _pair(host, cpus: tuple[float, float], *, one_core: bool = False):
    """Two nodes on different cores (``one_core``: on the same) with ``cpus`` of them, a 40 MB/s
    link one way and 10 MB/s back."""
    name = f"j{os.getpid() % 1000000}"[:8]
    spec = from_dict(
        TestbedSpec,
        {
            "kind": "Testbed",
            "schema_version": 1,
            "name": "pair",
            "nodes": [
                {"name": "na", "cpus": cpus[0], "cores": [host.cores[0]]},
                {"name": "nb", "cpus": cpus[1], "cores": [host.cores[0 if one_core else -1]]},
            ],
            "links": [
                {"src": "na", "dst": "nb", "bandwidth_gbps": 0.04},
                {"src": "nb", "dst": "na", "bandwidth_gbps": 0.01},
            ],
        },
        "pair.yaml",
    )
    state = up(spec, "pair.yaml", name=name, host=host, allow_no_latency=True)
    try:
        yield state
    finally:
        down(name)


@pytest.fixture
def slow_bed(host):
    """The pair at half a core and a quarter: what the profile must tell apart."""
    yield from _pair(host, (0.5, 0.25))


@pytest.fixture
def one_core_bed(host):
    """The pair on one core, 45% of it each: the shipped testbeds' nodes come in such pairs."""
    yield from _pair(host, (0.45, 0.45), one_core=True)


@pytest.fixture
def bed(host):
    """The pair at a whole core and a half, for jobs. At a quarter core (0.19 of one on an idle VM)
    nb was still starting when na's first send to it timed out after the 5 s collective timeout
    the fault tests use (to notice a fault quickly), and the job failed before its first step."""
    yield from _pair(host, (1.0, 0.5))


def _no_process_in(state) -> None:
    for node in state.nodes.values():
        pids = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout.split()
        assert not pids, f"processes left in {node.netns}: {pids}"


def _plan_file(tmp_path: Path, nodes: tuple[str, ...]) -> Path:
    """A bsp plan of the mlp over one worker on each of ``nodes`` of the pair testbed (global batch 8)."""
    devices = [f"{n}-cpu0" for n in nodes]
    plan = {
        "kind": "Plan",
        "schema_version": 1,
        "cluster": "pair",
        "model": MLP,
        "devices": devices,
        "global_batch": 8,
        "schedule": "tokens",
        "sync": {"mode": "bsp"},
        "stages": [
            {
                "layer_start": 0,
                "layer_end": 5,
                "micro_batch": 8 // len(nodes),
                "workers": [{"device": d, "share": 1 / len(nodes)} for d in devices],
            }
        ],
        "placement": [{"device": d, "node": n, "kind": "cpu", "local_index": 0} for d, n in zip(devices, nodes)],
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def _scale_onto_nb(runs: Path, run_id: str) -> subprocess.CompletedProcess:
    """`felactl scale RUN --add 1 --node nb`, as a user types it. The answer comes once the newcomer
    started in nb and joined: about 15 s on an idle machine; 60 s ran out once under CI's load."""
    command = [*FELACTL, "scale", run_id, "--runs-root", str(runs), "--add", "1", "--node", "nb", "--json"]
    return subprocess.run([*command, "--timeout", "150"], env=ENV, capture_output=True, text=True, timeout=180)


def _profile(bed, out: Path) -> dict:
    """``felactl profile --testbed`` of ``bed`` with small sizes; its JSON."""
    result = subprocess.run(
        [
            *FELACTL,
            "profile",
            "--testbed",
            bed.name,
            "-o",
            str(out),
            "--json",
            "--matmul-size",
            "128",
            "--message-bytes",
            str(2 * 2**20),
            "--repetitions",
            "3",
            "--join-timeout",
            "25",
            "--timeout",
            "60",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


@pytest.mark.multiprocess
def test_profile_measures_each_direction_of_the_testbed(slow_bed, tmp_path) -> None:
    bed = slow_bed
    data = _profile(bed, tmp_path / "cluster.yaml")
    assert data["name"] == "pair" and [n["name"] for n in data["nodes"]] == ["na", "nb"]
    links = {(l["src"], l["dst"]): l["bandwidth_gbps"] for l in data["links"]}
    assert links[("na-cpu0", "nb-cpu0")] == pytest.approx(0.04, rel=0.15), links
    assert links[("nb-cpu0", "na-cpu0")] == pytest.approx(0.01, rel=0.15), links
    speed = {node["name"]: node["devices"][0]["tflops"] for node in data["nodes"]}
    # The CPU shares are seen: nb measures about half as fast as na, where without its cgroup it
    # would measure as fast. Not the 15%: on this project's virtual machine a core's own
    # speed drifts by up to 30% from one minute to the next (0.049-0.075 TFLOP/s seen within ten
    # minutes), nodes on two cores drift apart, and a quarter core's quota under-delivers while the
    # host idles (felactl.testbed.cgroups.CPU_PERIOD_US); seen here: 0.32-0.58. The 15% target is
    # measured on every shipped testbed by benchmarks/bench_testbed.py (BENCHMARKS.md).
    assert 0.2 <= speed["nb"] / speed["na"] <= 0.8, speed
    # each node's device is named by its share, as the model's timings in it are keyed
    models = {node["name"]: node["devices"][0]["model"] for node in data["nodes"]}
    assert models["na"].endswith(" @ 0.5 cores") and models["nb"].endswith(" @ 0.25 cores"), models
    _no_process_in(bed)


@pytest.mark.multiprocess
def test_the_model_is_timed_in_every_node_and_keyed_by_its_share(slow_bed, tmp_path) -> None:
    """``felactl profile --model --testbed``: each node times the model in its namespace and
    cgroup, at once; one profile holds both, under the device models the cluster profile names."""
    out = tmp_path / "model.yaml"
    command = [*FELACTL, "profile", "--model", "mlp", "--config", "hidden=64", "--config", "depth=1"]
    command += ["--batch-sizes", "16,256", "--repetitions", "2", "--matmul-size", "128"]
    command += ["--testbed", slow_bed.name, "-o", str(out), "--json"]
    result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    spec = yaml.safe_load(out.read_text())
    by_model = {}
    for layer in spec["layers"]:
        for t in layer["timings"]:
            by_model.setdefault(t["device_model"], {}).setdefault(t["micro_batch"], 0.0)
            by_model[t["device_model"]][t["micro_batch"]] += t["fwd_ms"] + t["bwd_ms"]
    half, quarter = (next(m for m in by_model if m.endswith(share)) for share in (" @ 0.5 cores", " @ 0.25 cores"))
    assert (
        set(by_model) == {half, quarter} == set(spec["timed_tflops"]) == set(spec["optimizer_step_ms_by_device_model"])
    )
    # at a quarter of a core the model's step takes longer than at a half (about twice)
    assert by_model[quarter][256] > 1.25 * by_model[half][256], by_model
    _no_process_in(slow_bed)


@pytest.mark.multiprocess
def test_profile_reads_a_messages_latency_between_nodes_that_share_a_core(one_core_bed, tmp_path) -> None:
    """Round trips back to back between two capped nodes of one core read the CPU period (4-5 ms
    one way: each spends its quota waiting for the other), where a message takes well under a
    millisecond and the planner prices every ring step and tree piece by that latency."""
    data = _profile(one_core_bed, tmp_path / "cluster.yaml")
    latency_us = {(l["src"], l["dst"]): l["latency_us"] for l in data["links"]}
    assert len(latency_us) == 2 and max(latency_us.values()) < 1000, latency_us
    _no_process_in(one_core_bed)


@pytest.mark.multiprocess
def test_launch_runs_a_two_node_plan_inside_the_testbed(bed, tmp_path) -> None:
    path = _plan_file(tmp_path, ("na", "nb"))
    result = subprocess.run(
        [
            *FELACTL,
            "launch",
            str(path),
            "--testbed",
            bed.name,
            "--steps",
            "3",
            "--json",
            "--runs-root",
            str(tmp_path / "runs"),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    assert summary["steps"] == 3 and len(summary["workers"]) == 2
    logs = Path(summary["run_dir"]) / "logs"
    assert (logs / "testbed-na.log").exists() and (logs / "testbed-nb.log").exists()
    _no_process_in(bed)
    # a plan for nodes the testbed lacks is refused in one line
    plan = yaml.safe_load(path.read_text())
    plan["placement"][1]["node"] = "elsewhere"
    path.write_text(yaml.safe_dump(plan))
    result = subprocess.run(
        [*FELACTL, "launch", str(path), "--testbed", bed.name, "--runs-root", str(tmp_path / "runs")],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "which testbed" in result.stderr and "lacks" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.multiprocess
def test_an_agent_in_a_node_joins_a_running_launch_and_scale_puts_a_worker_there(bed, tmp_path) -> None:
    """Item 2's `felactl agent` and `felactl scale --node` in a testbed: the job starts on na; an agent
    started in nb (felactl testbed exec, README's recipe: no --node-name, it takes the node's name) joins
    it, and `scale --add 1 --node nb` runs a worker there."""
    path = _plan_file(tmp_path, ("na",))
    runs = tmp_path / "runs"
    for src, dst in (("na", "nb"), ("nb", "na")):  # fast steps once there are two workers: a short drain at the end
        set_link(bed.name, src, dst, bandwidth_gbps=0.2)
    launch = subprocess.Popen(
        [
            *FELACTL,
            "launch",
            str(path),
            "--testbed",
            bed.name,
            "--steps",
            "100000",
            "--run-id",
            "grow",
            "--runs-root",
            str(runs),
            "--max-nproc-per-node",
            "1",
        ],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    agent = None
    try:
        events = runs / "grow" / "events.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (events.exists() and '"kind":"start"' in events.read_text()):
            time.sleep(0.2)
        launched = json.loads(events.read_text().splitlines()[0])
        assert launched["endpoint"].startswith(bed.host_address + ":")
        agent = subprocess.Popen(
            [
                *FELACTL,
                "testbed",
                "exec",
                "nb",
                "--name",
                bed.name,
                "--",
                *FELACTL,
                "agent",
                "--rdzv-endpoint",
                launched["endpoint"],
                "--secret-file",
                str(runs / "grow" / "secret"),
                "--nproc-per-node",
                "1",
                "--job",
                "grow",
            ],
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        while time.monotonic() < deadline and '"kind":"node-joined"' not in events.read_text():
            time.sleep(0.2)
        scaled = _scale_onto_nb(runs, "grow")
        assert scaled.returncode == 0, scaled.stderr
        out = json.loads(scaled.stdout)
        assert out["kind"] == "scale-out" and out["members_after"] == [0, 1]
    finally:
        launch.send_signal(signal.SIGINT)
        launch.wait(timeout=60)
        if agent is not None:
            agent.wait(timeout=30)
    _no_process_in(bed)


def _start_elastic_pair(bed, tmp_path: Path, run_id: str, steps: int, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    """An elastic bsp job on na and nb (one worker each, fast links), failures noticed within 3 s of
    silence and a collective that waits 5 s at most."""
    for src, dst in (("na", "nb"), ("nb", "na")):
        set_link(bed.name, src, dst, bandwidth_gbps=0.2)
    command = [*FELACTL, "launch", str(_plan_file(tmp_path, ("na", "nb"))), "--testbed", bed.name]
    command += ["--steps", str(steps), "--json", "--run-id", run_id, "--runs-root", str(tmp_path / "runs")]
    command += ["--elastic", "--heartbeat-timeout", "3", "--collective-timeout", "5", "--max-nproc-per-node", "1"]
    return subprocess.Popen(command, env=ENV, stdout=stdout, stderr=subprocess.PIPE, text=True)


def _wait_training(run: Path, records: int = 20, timeout_s: float = 60) -> None:
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= records):
        assert time.monotonic() < deadline, f"fewer than {records} metric records within {timeout_s} s"
        time.sleep(0.2)


def _wait_event(run: Path, kinds: tuple[str, ...], timeout_s: float) -> float:
    """When (monotonic) an event of one of ``kinds`` was first seen in the run's events.jsonl."""
    events = run / "events.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = events.read_text() if events.exists() else ""
        if any(f'"kind":"{kind}"' in text for kind in kinds):
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"no {' or '.join(kinds)} event within {timeout_s} s: {text}")


def _steps_of_rank_0(run: Path) -> list[int]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return sorted({r["step"] for r in records if r["rank"] == 0})


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", ["cut", "crash", "partition"])
def test_a_node_that_fails_is_dropped_and_the_job_finishes_on_the_rest(bed, tmp_path, fault) -> None:
    """Item 6, in the middle of an elastic bsp job: nb's cable is pulled (every packet to and from it
    dropped, its connections hang instead of closing), or every process in nb (its agent and its
    worker) is killed, or na and nb are partitioned apart while both still heartbeat to the
    coordinator (the two halves as large: the one of the lowest worker id goes on). The coordinator
    notices within the heartbeat timeout (a partition: when the collective times out), na goes on
    alone, and every step is done once, none lost."""
    from felactl.testbed.faults import crash_node, cut_node, partition_nodes, partitioned

    inject = {
        "cut": lambda: cut_node(bed.name, "nb"),
        "crash": lambda: crash_node(bed.name, "nb"),
        # na and nb no longer reach each other, while both still reach the coordinator on the bridge
        "partition": lambda: partition_nodes(bed.name, ["na"]),
    }
    steps, run = 400, tmp_path / "runs" / "fail"
    launch = _start_elastic_pair(bed, tmp_path, "fail", steps, stdout=subprocess.PIPE)
    try:
        _wait_training(run)
        failed_at = time.monotonic()
        inject[fault]()
        dropped_at = _wait_event(run, ("failure", "scale-in"), timeout_s=60)
        out, err = launch.communicate(timeout=120)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
        cut_node(bed.name, "nb", cut=False)
        if partitioned(bed.name):
            partition_nodes(bed.name, [], apart=False)
    assert launch.returncode == 0, err[-2000:]
    assert dropped_at - failed_at < 3 + 5 + 5
    assert json.loads(out)["steps"] == steps
    assert _steps_of_rank_0(run) in (list(range(steps)), list(range(1, steps + 1))), "a step lost or skipped"
    failure = next(
        e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["kind"] == "failure"
    )
    assert failure["members_after"] == [0]
    if fault == "partition":  # not taken for dead: nb's worker lived, and was dropped for being apart
        assert "cut off from worker(s) 0 by a network partition" in failure["reason"], failure["reason"]


@pytest.mark.multiprocess
def test_a_node_cut_off_and_connected_again_rejoins_with_its_agent_and_scale(bed, tmp_path) -> None:
    """Item 6, the way back: after nb was cut off and dropped, its link comes back; nb's agent is heard
    again and `scale --add 1 --node nb` puts a worker there. Then Ctrl-C: the stop is checkpointed."""
    from felactl.testbed.faults import cut_node

    runs, run = tmp_path / "runs", tmp_path / "runs" / "back"
    launch = _start_elastic_pair(bed, tmp_path, "back", 100000)
    try:
        _wait_training(run)
        cut_node(bed.name, "nb")
        _wait_event(run, ("failure",), timeout_s=30)
        cut_node(bed.name, "nb", cut=False)
        # nb's agent outlived the cut (its connections hung, they did not close): once its beat is
        # heard again, a scale-out may put a worker on nb.
        deadline = time.monotonic() + 60
        while True:
            scaled = _scale_onto_nb(runs, "back")
            if scaled.returncode == 0 or time.monotonic() > deadline or "silent" not in scaled.stderr:
                break
            time.sleep(1)
        assert scaled.returncode == 0, scaled.stderr
        out = json.loads(scaled.stdout)
        assert out["kind"] == "scale-out" and len(out["members_after"]) == 2, out
    finally:
        launch.send_signal(signal.SIGINT)
        launch.wait(timeout=60)
        cut_node(bed.name, "nb", cut=False)
    done = _steps_of_rank_0(run)
    assert done == list(range(done[0], done[-1] + 1)), "a step lost or skipped"
    # Ctrl-C's graceful stop checkpoints the step it stops at, in the nodes' agents too (they were
    # terminated before their workers could, and the run stopped with no checkpoint)
    stopped = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()][-1]
    assert stopped["kind"] == "stopped" and stopped["checkpoint_step"] is not None, stopped
    assert (run / "checkpoints" / f"step{stopped['checkpoint_step']:06d}").is_dir()
