"""``felactl profile`` and ``felactl agent`` through typer's CliRunner (real worker processes, gloo)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.launcher.controlplane import Coordinator, new_secret, write_secret_file
from felactl.spec import load_cluster

runner = CliRunner()
SMALL = [
    "--matmul-size",
    "128",
    "--message-bytes",
    "262144",
    "--repetitions",
    "3",
    "--timeout",
    "60",
    "--join-timeout",
    "30",
]


@pytest.mark.multiprocess
def test_profile_two_cpu_slots_json(tmp_path):
    out = tmp_path / "cluster.yaml"
    started = time.monotonic()
    result = runner.invoke(
        app,
        [
            "profile",
            "--nproc-per-node",
            "2",
            "--node-name",
            "box",
            "-o",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
            "--json",
            *SMALL,
        ],
    )
    assert result.exit_code == 0, result.stderr
    assert time.monotonic() - started < 60
    data = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert data["kind"] == "Cluster" and data["profile_s"] > 0
    names = [d["name"] for node in data["nodes"] for d in node["devices"]]
    assert names == ["box-cpu0", "box-cpu1"]
    assert all(d["tflops"] > 0 and d["kind"] == "cpu" for node in data["nodes"] for d in node["devices"])
    pairs = {(link["src"], link["dst"]): link for link in data["links"]}
    assert set(pairs) == {("box-cpu0", "box-cpu1"), ("box-cpu1", "box-cpu0")}
    assert all(l["bandwidth_gbps"] > 0 and l["latency_us"] > 0 and l["type"] == "loopback" for l in pairs.values())

    cluster = load_cluster(out)  # the file is the same cluster, valid
    assert cluster.device_names == tuple(names)
    cores0, cores1 = (set(d.cpu_cores) for d in cluster.devices)
    assert cores0 and cores1 and (cores0.isdisjoint(cores1) or len(cores0 | cores1) == 1)  # pinned apart
    assert (tmp_path / "logs" / "worker-0.log").exists()


@pytest.mark.multiprocess
def test_profile_table_goes_to_stderr_and_no_temp_dir_is_left(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    result = runner.invoke(app, ["profile", "--nproc-per-node", "2", "-o", str(tmp_path / "c.yaml"), *SMALL])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    assert "links" in result.stderr and "loopback" in result.stderr
    assert not list((tmp_path / "tmp").glob("felactl-profile-*"))  # the workers' logs of a success: gone


def test_profile_port_in_use_exits_2(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["profile", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nnodes", "1"])
    assert result.exit_code == 2
    assert not list(tmp_path.glob("felactl-profile-*"))  # nothing ran: no temp dir either
    assert result.stderr.strip().splitlines()[-1] == (
        f"felactl: error: port {port} on 127.0.0.1 is already in use; pick another with --rdzv-endpoint"
    )


@pytest.mark.parametrize(
    "flags, said",
    [
        ([], "no testbed 'nosuch' is up"),
        (["--cluster", "c.yaml"], "--testbed times the model in each node of the testbed: not with --cluster"),
        (["--device", "cuda"], "--testbed profiles the nodes' CPU slots; --device is cuda"),
    ],
)
def test_a_model_profile_on_a_testbed_refuses_what_it_cannot_do(tmp_path, flags, said):
    result = runner.invoke(
        app, ["profile", "--model", "mlp", "--testbed", "nosuch", *flags, "-o", str(tmp_path / "m.yaml")]
    )
    assert result.exit_code == 2 and said in result.stderr, result.stderr
    assert not (tmp_path / "m.yaml").exists()


def test_hostfile_without_endpoint_exits_2(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("w1 slots=2\n")
    result = runner.invoke(app, ["profile", "--hostfile", str(hosts)])
    assert result.exit_code == 2 and "--hostfile needs --rdzv-endpoint" in result.stderr


@pytest.fixture
def serving_coordinator():
    """A coordinator whose joins are handled by a background thread, as ``felactl profile`` would."""
    coordinator = Coordinator(new_secret(), job="job")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            coordinator.poll_joins()
            time.sleep(0.02)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        yield coordinator
    finally:
        stop.set()
        server.join(timeout=5)
        coordinator.close()


def test_agent_with_wrong_secret_exits_2_and_the_coordinator_is_unaffected(tmp_path, serving_coordinator):
    coordinator = serving_coordinator
    wrong = tmp_path / "wrong-secret"
    write_secret_file(wrong)
    result = runner.invoke(
        app,
        [
            "agent",
            "--rdzv-endpoint",
            coordinator.endpoint,
            "--secret-file",
            str(wrong),
            "--nproc-per-node",
            "1",
            "--join-timeout",
            "3",
            "--job",
            "job",
        ],
    )
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("felactl:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"felactl: error: the coordinator at {coordinator.endpoint} refused this agent: "
        "wrong job secret (check --secret-file): none of "
    )
    assert "Traceback" not in result.stderr
    # Refused after each of its fresh hellos; it cannot verify the refusals, so it tries until
    # its --join-timeout (someone without the secret could have forged them)
    assert coordinator.members == {} and len(coordinator.refused) >= 1


def test_agent_unreachable_coordinator_exits_1(tmp_path):
    secret = tmp_path / "secret"
    write_secret_file(secret)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = runner.invoke(
        app, ["agent", "--rdzv-endpoint", f"127.0.0.1:{port}", "--secret-file", str(secret), "--join-timeout", "1"]
    )
    assert result.exit_code == 1
    assert f"cannot reach the coordinator at 127.0.0.1:{port}" in result.stderr


def test_agent_missing_secret_file_exits_2(tmp_path):
    result = runner.invoke(app, ["agent", "--rdzv-endpoint", "127.0.0.1:1", "--secret-file", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "no such secret file" in result.stderr


@pytest.mark.multiprocess
def test_a_failing_worker_fails_the_profile_and_leaves_no_process(tmp_path, monkeypatch):
    import psutil

    import felactl.launcher.profile as cluster

    monkeypatch.setattr(cluster, "WORKER_MODULE", "felactl.profiling.no_such_worker")
    # Only what this test starts: earlier tests may leave multiprocessing's resource tracker.
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "cluster.yaml"
    result = runner.invoke(
        app,
        [
            "profile",
            "--nproc-per-node",
            "2",
            "--node-name",
            "box",
            "-o",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
            *SMALL,
        ],
    )
    assert result.exit_code == 1
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("felactl: error: a profiling worker on box failed (rank ")
    assert "No module named felactl.profiling.no_such_worker" in error and str(tmp_path / "logs") in error
    assert not out.exists()
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before] == []


@pytest.mark.parametrize(
    "args,problem",
    [
        (["--nnodes", "2"], "--nnodes needs --rdzv-endpoint"),
        (["--rdzv-endpoint", "127.0.0.1:0", "--nproc-per-node", "2"], "--nproc-per-node is each agent's option"),
        (["--rdzv-endpoint", "nohost"], "expected HOST:PORT"),
        (["--device", "tpu"], "--device must be auto, cpu or cuda"),
        (["--repetitions", "0"], "repetitions must be >= 1"),
    ],
)
def test_profile_flag_mistakes_exit_2(tmp_path, args, problem):
    result = runner.invoke(app, ["profile", "-o", str(tmp_path / "c.yaml"), *args])
    assert result.exit_code == 2, result.stderr
    assert problem in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "c.yaml").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_profile_device_cuda_without_gpus_exits_2(tmp_path):
    result = runner.invoke(
        app,
        [
            "profile",
            "--device",
            "cuda",
            "--node-name",
            "box",
            "-o",
            str(tmp_path / "c.yaml"),
            "--log-dir",
            str(tmp_path / "logs"),
            *SMALL,
        ],
    )
    assert result.exit_code == 2
    assert "--device cuda: node box has 0 GPU(s) for 2 slot(s)" in result.stderr


def test_agent_reads_the_secret_from_stdin(serving_coordinator):
    """``--secret-file -`` is how ssh hands the secret over; a wrong one read there is refused (exit 2)."""
    coordinator = serving_coordinator
    result = runner.invoke(
        app,
        [
            "agent",
            "--rdzv-endpoint",
            coordinator.endpoint,
            "--secret-file",
            "-",
            "--join-timeout",
            "3",
            "--job",
            "job",
        ],
        input=new_secret() + "\n",
    )
    assert result.exit_code == 2 and "refused this agent" in result.stderr
    assert len(coordinator.refused) >= 1
