"""Pure parts of profiling: assembling a ClusterSpec, nvidia-smi topology, hostfiles, ssh commands."""

from __future__ import annotations

import pytest

from felactl.errors import InputError
from felactl.launcher.controlplane import Member
from felactl.launcher.hosts import Host, agent_ssh_command, parse_hostfile
from felactl.profiling.cluster import assemble_cluster
from felactl.profiling.devices import gpu_interconnect, parse_nvidia_smi_topo
from felactl.spec import ClusterSpec, LinkType, from_dict, to_dict


def _member(node: str, slots: int, gpus: int = 0) -> Member:
    return Member(
        agent_id=f"{node}-x",
        node_name=node,
        num_slots=slots,
        hostname=node,
        info={"hostname": node, "num_cpu_cores": 8, "memory_gb": 64.0, "num_gpus": gpus},
    )


def _links(rank: int, world: int, gbps: float) -> list[dict]:
    return [
        {"src_rank": rank, "dst_rank": d, "bandwidth_gbps": gbps + d, "latency_us": 10.0 + d}
        for d in range(world)
        if d != rank
    ]


def test_assemble_names_types_and_every_ordered_pair():
    members = [_member("a", 2), _member("b", 1)]
    cpu = {"kind": "cpu", "model": "Xeon", "tflops": 0.1, "memory_gb": 32.0}
    results = {
        r: {"rank": r, "local_rank": lr, "device": {**cpu, "cpu_cores": [lr]}, "links": _links(r, 3, 1.0)}
        for r, lr in [(0, 0), (1, 1), (2, 0)]
    }
    cluster = assemble_cluster("lab", members, results)
    assert cluster.device_names == ("a-cpu0", "a-cpu1", "b-cpu0")
    assert [n.name for n in cluster.nodes] == ["a", "b"]
    assert len(cluster.links) == 6
    assert cluster.link("a-cpu0", "a-cpu1").type is LinkType.LOOPBACK
    assert cluster.link("a-cpu1", "b-cpu0").type is LinkType.NET
    assert cluster.link("b-cpu0", "a-cpu1").bandwidth_gbps == 2.0  # measured by rank 2 towards rank 1
    assert cluster.device("a-cpu1").cpu_cores == (1,)
    assert from_dict(ClusterSpec, to_dict(cluster)) == cluster


def test_assemble_gpu_links_follow_the_node_topology():
    gpu = {"kind": "cuda", "model": "H100", "tflops": 50.0, "bf16_tflops": 700.0, "memory_gb": 80.0}
    topology = {"0,1": {"type": "nvlink", "num_links": 18}, "1,0": {"type": "nvlink", "num_links": 18}}
    results = {
        0: {"rank": 0, "local_rank": 0, "device": gpu, "links": _links(0, 2, 300.0), "topology": topology},
        1: {"rank": 1, "local_rank": 1, "device": gpu, "links": _links(1, 2, 300.0)},
    }
    cluster = assemble_cluster("box", [_member("box", 2, gpus=2)], results)
    link = cluster.link("box-gpu0", "box-gpu1")
    assert (link.type, link.num_links) == (LinkType.NVLINK, 18)
    assert cluster.device("box-gpu1").bf16_tflops == 700.0


TOPO = """\x1b[4mGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\x1b[0m
GPU0\t X \tNV4\tSYS\t0-23\t0
GPU1\tNV4\t X \tPHB\t0-23\t0
GPU2\tSYS\tPHB\t X \t24-47\t1

Legend:
  X    = Self
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def test_parse_nvidia_smi_topo():
    assert parse_nvidia_smi_topo(TOPO, 3) == {(0, 1): 4, (1, 0): 4}
    assert parse_nvidia_smi_topo("No devices were found", 2) is None


def test_gpu_interconnect_without_nvml_or_smi_is_pcie(monkeypatch):
    import felactl.profiling.devices as devices

    monkeypatch.setattr(devices, "_nvml_nvlinks", lambda n: None)
    monkeypatch.setattr(devices, "_smi_nvlinks", lambda n: {(0, 1): 2})
    assert gpu_interconnect(2) == {(0, 1): {"type": "nvlink", "num_links": 2}, (1, 0): {"type": "pcie", "num_links": 1}}


def test_parse_hostfile():
    text = "# lab\nworker-1 slots=4\n\nworker-2 slots=2  # the slow one\nworker-3\n"
    assert parse_hostfile(text) == [
        Host(hostname="worker-1", num_slots=4),
        Host(hostname="worker-2", num_slots=2),
        Host(hostname="worker-3", num_slots=1),
    ]


@pytest.mark.parametrize(
    "text,problem",
    [
        ("a slots=0", "positive"),
        ("a slots=x", "positive"),
        ("a gpus=2", "expected"),
        ("a slots=1\na slots=2", "twice"),
        ("# nothing\n", "no hosts"),
    ],
)
def test_parse_hostfile_rejects(text, problem):
    with pytest.raises(InputError, match=problem):
        parse_hostfile(text, "hosts.txt")


def test_agent_ssh_command_keeps_the_secret_off_the_command_line():
    command = agent_ssh_command(Host(hostname="w1", num_slots=4), "10.0.0.5:29400", job="run-7")
    assert command[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new"]
    assert command[5] == "w1"
    assert command[6] == (
        "felactl agent --rdzv-endpoint 10.0.0.5:29400 --secret-file - --nproc-per-node 4 --node-name w1 --job run-7"
    )


def test_a_profiling_worker_times_its_device_after_every_worker_has_joined(monkeypatch):
    """The device's matmul is timed after the process group formed and a barrier passed (every
    worker started), not as the worker comes up beside the others' starts; and again, all at once,
    after the links, keeping the faster reading."""
    import json

    import torch.distributed as dist

    import felactl.control.store
    import felactl.profiling.links
    from felactl.profiling import worker

    calls: list[str] = []
    results: list[dict] = []

    class Store:
        def add(self, key, n):
            return 0

        def set(self, key, value):
            calls.append("result")
            results.append(json.loads(value))

    monkeypatch.setattr(felactl.control.store, "connect_store", lambda *a: Store())
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: store)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append("join"))
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    readings = iter([{"tflops": 1.0, "bf16_tflops": 3.0}, {"tflops": 2.0, "bf16_tflops": 2.5}])
    monkeypatch.setattr(worker, "_device_result", lambda *a: calls.append("device") or next(readings))
    monkeypatch.setattr(felactl.profiling.links, "measure_links", lambda *a, **k: calls.append("links") or [])
    config = {
        "device": "cpu",
        "timeout_s": 5,
        "message_bytes": 1,
        "small_message_bytes": 1,
        "repetitions": 1,
        "latency_repetitions": 1,
    }
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": "1", "FELACTL_STORE_PREFIX": "p/"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FELACTL_PROFILE_CONFIG", json.dumps(config))
    worker.main()
    assert calls[:7] == ["join", "barrier", "device", "links", "barrier", "device", "result"]
    # timed twice, the links between: each throughput at its faster reading (a stall only slows)
    assert results[0]["device"] == {"tflops": 2.0, "bf16_tflops": 3.0}


def test_of_two_readings_each_throughput_is_its_faster_and_a_missing_one_stays_missing():
    from felactl.profiling.worker import faster_reading

    cpu = {"kind": "cpu", "model": "Xeon", "tflops": 0.05, "cpu_cores": [0]}
    assert faster_reading(cpu, {**cpu, "tflops": 0.07}) == {**cpu, "tflops": 0.07}
    assert faster_reading({**cpu, "tflops": 0.07}, cpu)["tflops"] == 0.07
    assert "bf16_tflops" not in faster_reading(cpu, cpu)
    gpu = {"kind": "cuda", "tflops": 50.0, "bf16_tflops": None}
    assert faster_reading(gpu, {**gpu, "bf16_tflops": 400.0})["bf16_tflops"] == 400.0
    assert faster_reading(gpu, gpu)["bf16_tflops"] is None
