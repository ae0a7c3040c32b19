"""Jobs inside a testbed: ``felactl profile --testbed`` and ``felactl launch --testbed`` run each
node's agent in its namespace and cgroup (gloo on its ``fl0``), the coordinator on the bridge.
Needs root; skips with the reason elsewhere.

Each testbed is up once for the module (up takes half a second; the jobs' processes, importing
torch in a capped node, take the time): ``slow_bed`` for the profiles, ``bed`` for the jobs. The
faults a job only has to outlive are made one after another on one shared job (``grown``):
launched on na, joined by an agent in nb and scaled onto it, then nb cut off and connected
again, then partitioned away; the last test stops it with Ctrl-C. A crash, after which a job
finishes its steps on the rest, gets a job of its own."""

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

from felactl.testbed import TestbedUnavailable, down, probe_host, up
from felactl.testbed.faults import crash_node, cut_node, partition_nodes, partitioned
from tests.testbed_fixtures import jobs_alone, pair

ROOT = Path(__file__).resolve().parent.parent
FELACTL = [sys.executable, "-m", "felactl"]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    "OMP_NUM_THREADS": "1",
}
MLP = {"name": "mlp", "source": "mlp", "config": {"input_dim": 256, "hidden": 512, "depth": 4, "num_classes": 10}}
NOTICED_S = 3 + 5 + 5
"""A fault is noticed within this: the heartbeat timeout, the collective timeout, and slack."""


@pytest.fixture(scope="module")
def host():
    try:
        found = probe_host()
    except TestbedUnavailable as exc:
        pytest.skip(str(exc))
    with jobs_alone():
        yield found


def _pair(host, tag: str, cpus: tuple[float, float], gbps: tuple[float, float], *, one_core: bool):
    """Two nodes na and nb with ``cpus`` of a core each, on one core (``one_core``) or on two, and
    links of ``gbps`` na -> nb and back; removed afterwards whatever happened."""
    name = f"{tag}{os.getpid() % 1000000}"[:8]
    spec = pair(host, cpus, gbps, one_core=one_core)
    state = up(spec, "pair.yaml", name=name, host=host, allow_no_latency=True)
    try:
        yield state
    finally:
        down(name)


@pytest.fixture(scope="module")
def slow_bed(host):
    """The pair on one core, at half of it and a quarter (what the profiles must tell apart), with
    a 40 MB/s link one way and 10 MB/s back. The shipped testbeds' nodes come in such pairs."""
    yield from _pair(host, "s", (0.5, 0.25), (0.04, 0.01), one_core=True)


@pytest.fixture(scope="module")
def bed(host):
    """The pair at a whole core and a half, on two cores, with fast links (200 MB/s), for jobs. At
    a quarter core (0.19 of one on an idle VM) nb was still starting when na's first send to it
    timed out after the 5 s collective timeout the fault tests use (to notice a fault quickly), and
    the job failed before its first step."""
    yield from _pair(host, "j", (1.0, 0.5), (0.2, 0.2), one_core=False)


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


def _launch_elastic(
    bed, tmp_path: Path, nodes: tuple[str, ...], run_id: str, steps: int, stdout=subprocess.DEVNULL, stderr=None
):
    """`felactl launch --testbed` of an elastic bsp job on one worker in each of ``nodes``, failures
    noticed within 3 s of silence and a collective that waits 5 s at most; its stderr to a pipe
    unless ``stderr`` (a file) is given."""
    command = [*FELACTL, "launch", str(_plan_file(tmp_path, nodes)), "--testbed", bed.name]
    command += ["--steps", str(steps), "--json", "--run-id", run_id, "--runs-root", str(tmp_path / "runs")]
    command += ["--elastic", "--heartbeat-timeout", "3", "--collective-timeout", "5", "--max-nproc-per-node", "1"]
    # a worker `scale --add` starts in nb (half a core) took over the default 60 s to be ready once
    # under the full suite's load, and over 120 s once in CI; below `_scale_onto_nb`'s 270 s, so
    # that a refusal still arrives
    command += ["--join-timeout", "240"]
    return subprocess.Popen(command, env=ENV, stdout=stdout, stderr=stderr or subprocess.PIPE, text=True)


def _scale_onto_nb(runs: Path, run_id: str) -> subprocess.CompletedProcess:
    """`felactl scale RUN --add 1 --node nb`, as a user types it. The answer comes once the newcomer
    started in nb and joined: about 15 s on an idle machine, 20 s beside six busy loops; 60 s ran
    out once under CI's load, and a join timeout of 120 s once too."""
    command = [*FELACTL, "scale", run_id, "--runs-root", str(runs), "--add", "1", "--node", "nb", "--json"]
    return subprocess.run([*command, "--timeout", "270"], env=ENV, capture_output=True, text=True, timeout=300)


def _jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSON-lines file that is being written (the last may be half there)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1] if line]


def _events(run: Path) -> list[dict]:
    return _jsonl(run / "events.jsonl")


def _wait_event(run: Path, kinds: tuple[str, ...], timeout_s: float, after: int = 0) -> dict:
    """The first event of one of ``kinds`` after the run's first ``after`` events, as soon as it is
    there (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = _events(run)
        seen = [e for e in events[after:] if e["kind"] in kinds]
        if seen:
            return seen[0]
        assert time.monotonic() < deadline, f"no {' or '.join(kinds)} event within {timeout_s} s: {events[after:]}"
        time.sleep(0.1)


def _wait_training(run: Path, workers: int, generation: int = 0, records: int = 10, timeout_s: float = 60) -> None:
    """Until ``workers`` ranks have each written ``records`` metric records in ``generation`` or later."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts: dict[int, int] = {}
        for r in _jsonl(run / "metrics.jsonl"):
            if r["generation"] >= generation:
                counts[r["rank"]] = counts.get(r["rank"], 0) + 1
        if sum(n >= records for n in counts.values()) >= workers:
            return
        assert time.monotonic() < deadline, (
            f"not {workers} worker(s) with {records} steps in generation {generation}+ within {timeout_s} s: {counts}"
        )
        time.sleep(0.2)


def _steps_of_rank_0(run: Path) -> list[int]:
    return sorted({r["step"] for r in _jsonl(run / "metrics.jsonl") if r["rank"] == 0})


def _stop(proc: subprocess.Popen | None, timeout_s: float) -> None:
    """Ctrl-C to ``proc`` if it still runs, and wait for it; killed if it outlives ``timeout_s``."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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
def test_profile_measures_each_direction_of_the_testbed(slow_bed, tmp_path, no_leftovers) -> None:
    """Each direction's bandwidth; each node's speed under its share, its device named by it; and
    each link's latency: round trips back to back between two capped nodes of one core read the
    CPU period (4-5 ms one way: each spends its quota waiting for the other), where a message takes
    well under a millisecond and the planner prices every ring step and tree piece by that latency."""
    bed = slow_bed
    data = _profile(bed, tmp_path / "cluster.yaml")
    assert data["name"] == "pair" and [n["name"] for n in data["nodes"]] == ["na", "nb"]
    links = {(l["src"], l["dst"]): l["bandwidth_gbps"] for l in data["links"]}
    assert links[("na-cpu0", "nb-cpu0")] == pytest.approx(0.04, rel=0.15), links
    assert links[("nb-cpu0", "na-cpu0")] == pytest.approx(0.01, rel=0.15), links
    latency_us = {(l["src"], l["dst"]): l["latency_us"] for l in data["links"]}
    assert len(latency_us) == 2 and max(latency_us.values()) < 1000, latency_us
    speed = {node["name"]: node["devices"][0]["tflops"] for node in data["nodes"]}
    # The CPU shares are seen: nb measures about half as fast as na, where without its cgroup it
    # would measure as fast. Not the 15%: on this project's virtual machine a core's own
    # speed drifts by up to 30% from one minute to the next (0.049-0.075 TFLOP/s seen within ten
    # minutes), and a quarter core's quota under-delivers while the host idles
    # (felactl.testbed.cgroups.CPU_PERIOD_US); seen here: 0.32-0.58. The 15% target is measured on
    # every shipped testbed by benchmarks/bench_testbed.py (BENCHMARKS.md).
    assert 0.2 <= speed["nb"] / speed["na"] <= 0.8, speed
    # each node's device is named by its share, as the model's timings in it are keyed
    models = {node["name"]: node["devices"][0]["model"] for node in data["nodes"]}
    assert models["na"].endswith(" @ 0.5 cores") and models["nb"].endswith(" @ 0.25 cores"), models
    _no_process_in(bed)


@pytest.mark.multiprocess
def test_the_model_is_timed_in_every_node_and_keyed_by_its_share(slow_bed, tmp_path, no_leftovers) -> None:
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
    # at a quarter of a core the model's step takes longer than at a half: about twice on a quiet
    # host, 1.2x in a full suite at -n 2 (the half node's share contended: CI stop 38's successor
    # failed a 1.25x bound), so only the order is asserted; the profile's accuracy is benchmarked
    assert all(by_model[quarter][b] > by_model[half][b] for b in (16, 256)), by_model
    _no_process_in(slow_bed)


@pytest.mark.multiprocess
def test_a_node_that_fails_is_dropped_and_the_job_finishes_on_the_rest(bed, tmp_path, no_leftovers) -> None:
    """`felactl launch --testbed` of a two-node plan: an agent and a worker in each node, their logs
    in the run. Item 6 in the middle of it: every process in nb (its agent and its worker) is
    killed. The coordinator notices within the heartbeat timeout, na goes on alone, and the job
    finishes its steps, every one done once, none lost. A plan for nodes the testbed lacks is
    refused in one line. (A cut and a partition are made on the shared job below.)"""
    steps, run = 150, tmp_path / "runs" / "fail"  # the crash comes near step 10, then na alone
    launch = _launch_elastic(bed, tmp_path, ("na", "nb"), "fail", steps, stdout=subprocess.PIPE)
    refused = None
    try:
        _wait_training(run, workers=2)
        failed_at = time.monotonic()
        assert crash_node(bed.name, "nb")
        _wait_event(run, ("failure", "scale-in"), timeout_s=60)
        dropped_at = time.monotonic()
        refused = _launch_elsewhere(bed, tmp_path)  # while na trains on alone, nb's core idles
        out, err = launch.communicate(timeout=120)
        refused_out, refused_err = refused.communicate(timeout=60)
    finally:
        for proc in (launch, refused):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert launch.returncode == 0, err[-2000:]
    assert dropped_at - failed_at < NOTICED_S
    summary = json.loads(out)
    assert summary["steps"] == steps and len(summary["workers"]) == 2
    assert _steps_of_rank_0(run) in (list(range(steps)), list(range(1, steps + 1))), "a step lost or skipped"
    failure = next(e for e in _events(run) if e["kind"] == "failure")
    assert failure["members_after"] == [0]
    logs = Path(summary["run_dir"]) / "logs"
    assert (logs / "testbed-na.log").exists() and (logs / "testbed-nb.log").exists()
    _no_process_in(bed)
    # a plan for nodes the testbed lacks is refused in one line
    assert refused.returncode == 2 and "which testbed" in refused_err and "lacks" in refused_err, refused_err
    assert len(refused_err.strip().splitlines()) == 1 and not refused_out


def _launch_elsewhere(bed, tmp_path: Path) -> subprocess.Popen:
    """`felactl launch --testbed` of the plan of ``tmp_path`` with nb's worker placed on a node the
    testbed lacks."""
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    plan["placement"][1]["node"] = "elsewhere"
    path = tmp_path / "elsewhere.yaml"
    path.write_text(yaml.safe_dump(plan))
    command = [*FELACTL, "launch", str(path), "--testbed", bed.name, "--runs-root", str(tmp_path / "runs")]
    return subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class Grown:
    """The shared job: its launch, nb's agent, and what growing it onto nb said. The two long-lived
    processes write their stderr to files beside the run (a pipe nobody reads could fill)."""

    def __init__(self, bed, tmp_path: Path):
        self.bed, self.tmp, self.runs = bed, tmp_path, tmp_path / "runs"
        self.run = self.runs / "grow"
        with (tmp_path / "launch.log").open("w") as log:
            self.launch = _launch_elastic(bed, tmp_path, ("na",), "grow", 100000, stderr=log)
        self.agent: subprocess.Popen | None = None
        self.joined: dict = {}
        self.scaled: dict = {}
        self.generation = 0

    def grow(self) -> None:
        """An agent started in nb (felactl testbed exec, README's recipe: no --node-name, it takes
        the node's name) joins the job, and `scale --add 1 --node nb` runs a worker there."""
        _wait_event(self.run, ("start",), timeout_s=60)
        self.endpoint = _events(self.run)[0]["endpoint"]  # the launch event's
        agent = [*FELACTL, "agent", "--rdzv-endpoint", self.endpoint, "--secret-file", str(self.run / "secret")]
        agent += ["--nproc-per-node", "1", "--job", "grow", "--log-dir", str(self.tmp / "agent-nb-logs")]
        with (self.tmp / "agent-nb.log").open("w") as log:
            self.agent = subprocess.Popen(
                [*FELACTL, "testbed", "exec", "nb", "--name", self.bed.name, "--", *agent],
                env=ENV,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        self.joined = _wait_event(self.run, ("node-joined",), timeout_s=60)
        scaled = _scale_onto_nb(self.runs, "grow")
        assert scaled.returncode == 0, f"{scaled.stderr}{self.why_slow()}"
        self.scaled = json.loads(scaled.stdout)
        self.generation = self.scaled["generation"]

    def why_slow(self) -> str:
        """What a grow that timed out leaves to read: the run's events with their times, the load,
        how often nb's cgroup was throttled, and the ends of nb's agent and worker logs."""
        start = _events(self.run)[0]["time"]
        lines = [f"{e['time'] - start:7.1f} s  {e['kind']}" for e in _events(self.run)]
        lines.append(f"loadavg: {Path('/proc/loadavg').read_text().strip()}")
        lines += [
            f"{p}: {p.read_text().split()}" for p in Path("/sys/fs/cgroup").rglob(f"*{self.bed.name}/nb/cpu.stat")
        ]
        for log in [self.tmp / "agent-nb.log", *sorted((self.tmp / "agent-nb-logs").glob("*.log"))]:
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(none)"
            lines.append(f"--- {log.name}:\n{tail}")
        return "\n" + "\n".join(lines)

    def said(self) -> str:
        """The end of the launch's stderr."""
        return (self.tmp / "launch.log").read_text(errors="replace")[-2000:]

    def two_training(self) -> None:
        """Fails at once unless the job runs on two workers, na's and nb's; then waits until both train."""
        assert self.launch.poll() is None, f"the shared job has ended: {self.said()}"
        changes = [(e["kind"], e["members_after"]) for e in _events(self.run) if "members_after" in e]
        assert changes and len(changes[-1][1]) == 2, f"the shared job is not on two workers: {changes}"
        _wait_training(self.run, workers=2, generation=self.generation)

    def close(self) -> None:
        _stop(self.launch, 60)
        _stop(self.agent, 30)
        cut_node(self.bed.name, "nb", cut=False)
        if partitioned(self.bed.name):
            partition_nodes(self.bed.name, [], apart=False)


@pytest.fixture(scope="module")
def grown(bed, tmp_path_factory):
    """The shared job of the tests below: an elastic bsp job launched on na alone, grown onto nb
    (:meth:`Grown.grow`). Each test leaves it as the next expects, the last stops it; it is stopped
    here too, whatever happened."""
    job = Grown(bed, tmp_path_factory.mktemp("grown"))
    try:
        job.grow()
        yield job
    finally:
        job.close()


@pytest.mark.multiprocess
def test_an_agent_in_a_node_joins_a_running_launch_and_scale_puts_a_worker_there(grown) -> None:
    """Item 2's `felactl agent` and `felactl scale --node` in a testbed: the shared job started on na,
    its coordinator on the bridge; an agent started in nb (README's recipe) joined it, and
    `scale --add 1 --node nb` ran a worker there (what ``grown`` did), which trains beside na's."""
    assert grown.endpoint.startswith(grown.bed.host_address + ":")
    assert grown.joined["kind"] == "node-joined"
    assert grown.scaled["kind"] == "scale-out" and grown.scaled["members_after"] == [0, 1]
    grown.two_training()


@pytest.mark.multiprocess
def test_a_node_cut_off_and_connected_again_rejoins_with_its_agent_and_scale(grown) -> None:
    """Item 6 in the shared job: nb's cable is pulled (every packet to and from it dropped, its
    connections hang instead of closing). The coordinator notices within the heartbeat timeout and
    na goes on alone. The way back: nb's link comes back, its agent is heard again, and
    `scale --add 1 --node nb` puts a worker there."""
    job = grown
    job.two_training()
    before = len(_events(job.run))
    failed_at = time.monotonic()
    try:
        cut_node(job.bed.name, "nb")
        _wait_event(job.run, ("failure", "scale-in"), timeout_s=60, after=before)
        dropped_at = time.monotonic()
    finally:
        cut_node(job.bed.name, "nb", cut=False)
    assert dropped_at - failed_at < NOTICED_S
    failure = _wait_event(job.run, ("failure",), timeout_s=0, after=before)
    assert failure["members_after"] == [0], failure
    # nb's agent outlived the cut (its connections hung, they did not close): once its beat is
    # heard again, a scale-out may put a worker on nb.
    deadline = time.monotonic() + 60
    while True:
        scaled = _scale_onto_nb(job.runs, "grow")
        if scaled.returncode == 0 or time.monotonic() > deadline or "silent" not in scaled.stderr:
            break
        time.sleep(1)
    assert scaled.returncode == 0, scaled.stderr
    out = json.loads(scaled.stdout)
    assert out["kind"] == "scale-out" and len(out["members_after"]) == 2, out
    job.generation = out["generation"]
    job.two_training()


@pytest.mark.multiprocess
def test_a_node_partitioned_away_is_dropped_and_the_job_goes_on_on_the_rest(grown) -> None:
    """Item 6 in the shared job: na and nb are partitioned apart while both still heartbeat to the
    coordinator (the two halves as large: the one of the lowest worker id goes on). The coordinator
    notices when the collective times out, drops nb's worker for being apart (it lived), and na
    trains on alone."""
    job = grown
    job.two_training()
    before = len(_events(job.run))
    failed_at = time.monotonic()
    try:
        partition_nodes(job.bed.name, ["na"])  # apart from each other, both still reach the coordinator
        _wait_event(job.run, ("failure", "scale-in"), timeout_s=60, after=before)
        dropped_at = time.monotonic()
    finally:
        partition_nodes(job.bed.name, [], apart=False)
    assert dropped_at - failed_at < NOTICED_S
    failure = _wait_event(job.run, ("failure",), timeout_s=0, after=before)
    assert failure["members_after"] == [0], failure
    assert "cut off from worker(s) 0 by a network partition" in failure["reason"], failure["reason"]
    _wait_training(job.run, workers=1, generation=failure["generation"])


@pytest.mark.multiprocess
def test_ctrl_c_stops_the_shared_job_checkpointed_and_no_step_was_lost(grown) -> None:
    """Ctrl-C's graceful stop checkpoints the step it stops at, in the testbed nodes' agents too
    (they were terminated before their workers could, and the run stopped with no checkpoint). And
    through the shared job's scale-outs and faults, rank 0 did every step once: none lost or skipped."""
    job = grown
    assert job.launch.poll() is None, f"the shared job has ended: {job.said()}"
    _stop(job.launch, 60)
    _stop(job.agent, 30)
    done = _steps_of_rank_0(job.run)
    assert done == list(range(done[0], done[-1] + 1)), "a step lost or skipped"
    stopped = _events(job.run)[-1]
    assert stopped["kind"] == "stopped" and stopped["checkpoint_step"] is not None, stopped
    assert (job.run / "checkpoints" / f"step{stopped['checkpoint_step']:06d}").is_dir()
    assert (job.run / "logs" / "testbed-na.log").exists()
    _no_process_in(job.bed)
