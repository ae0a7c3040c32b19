"""``felactl plan collectives`` through typer's CliRunner, attached to a ``plan`` group as felactl's is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from felactl.cli.main import FelactlGroup
from felactl.cli.plan_collectives import register_collectives

DGX = str(Path(__file__).resolve().parent.parent / "plans" / "clusters" / "dgx1v.yaml")
runner = CliRunner()


def _app() -> typer.Typer:
    app = typer.Typer(cls=FelactlGroup, pretty_exceptions_enable=False)

    @app.callback()
    def root() -> None:
        """felactl, as far as this test needs it."""

    plan_app = typer.Typer()
    register_collectives(plan_app)
    app.add_typer(plan_app, name="plan")
    return app


def test_json_for_three_gpus_by_index():
    result = runner.invoke(_app(), ["plan", "collectives", "--cluster", DGX, "--devices", "0,1,5", "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert set(data) == {
        "devices",
        "root",
        "roots",
        "trees",
        "reduce_trees",
        "rate_gbps",
        "bound_gbps",
        "ring_gbps",
        "solve_s",
        "allreduce_gbps",
        "allreduce_bound_gbps",
        "ring_allreduce_gbps",
        "root_bounds_gbps",
        "nccl_rings",  # GPUs: what a felactl job on them runs
        "nccl_allreduce_gbps",
    }
    assert data["devices"] == ["gpu0", "gpu1", "gpu5"]
    assert data["rate_gbps"] == 35.0 and data["bound_gbps"] == 35.0 and data["ring_gbps"] == 10.0
    # gpu0 has 25 + 10 GB/s each way: no allreduce beats 35, and the trees move one at that
    assert data["allreduce_gbps"] == pytest.approx(data["allreduce_bound_gbps"])
    assert data["ring_allreduce_gbps"] == pytest.approx(10.0 * 3 / 4)
    assert sum(t["weight"] for t in data["trees"]) == 35.0
    assert all(len(t["edges"]) == 2 and t["edges"][0][0] == data["root"] for t in data["trees"])


def test_names_root_and_human_table_on_stderr():
    result = runner.invoke(
        _app(),
        ["plan", "collectives", "--cluster", DGX, "--devices", "gpu0,gpu3,gpu2", "--root", "2", "--size-mb", "100"],
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    text = " ".join(result.stderr.split())  # rich wraps lines at the terminal's width
    # links of 50 (gpu0-gpu3), 25 (gpu0-gpu2) and 50 (gpu3-gpu2) each way: an allreduce among three
    # sends 4 transfers per element, so none beats 2 x 125 / 4 = 62.5, which the trees reach; their
    # broadcast alone could reach 75
    assert "root gpu2" in text and "allreduce 62.50 GB/s over the trees" in text
    assert "no allreduce can beat 62.50 GB/s here" in text
    assert "the trees' broadcast: rate 62.50 GB/s, min-cut bound 75.00 GB/s" in text
    assert "3.33x the best ring's 18.75" in text
    assert "allreduce of 100 MB: trees" in text


def test_bad_devices_exit_2_with_one_line():
    for devices, message in (
        ("0,1,9", "device index 9 is out of range"),
        ("gpu0,tpu1", "unknown device 'tpu1'"),
        (",", "--devices"),
    ):
        result = runner.invoke(_app(), ["plan", "collectives", "--cluster", DGX, "--devices", devices])
        assert result.exit_code == 2, (devices, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr


def test_missing_cluster_file_exits_2(tmp_path):
    result = runner.invoke(_app(), ["plan", "collectives", "--cluster", str(tmp_path / "none.yaml")])
    assert result.exit_code == 2
    assert "no such file" in result.stderr


def test_trees_bound_by_a_slow_slot_s_cpu_say_so(tmp_path):
    """Four CPU slots on an even 50 MB/s network, one held to 0.12 of a core (the one-slow
    testbed as `felactl profile --testbed` describes it): 16 MB over the trees takes the slow
    slot's messages, not the links, and the reader is told where the time goes."""
    from felactl.spec import from_dict, save
    from felactl.spec.cluster import ClusterSpec

    names = ["fast0", "fast1", "fast2", "slow"]
    cluster = {
        "kind": "Cluster",
        "schema_version": 1,
        "name": "one-slow",
        "nodes": [  # one "server": each pair's link its own, as a testbed shapes them
            {
                "name": "testbed",
                "devices": [
                    {
                        "name": f"{n}-cpu0",
                        "kind": "cpu",
                        "model": "Xeon @ 0.12 cores" if n == "slow" else "Xeon @ 0.45 cores",
                        "tflops": 0.01,
                        "memory_gb": 1.0,
                    }
                    for n in names
                ],
            }
        ],
        "intra_node_default": {"bandwidth_gbps": 0.05, "latency_us": 50.0, "type": "net"},
    }
    path = save(from_dict(ClusterSpec, cluster), tmp_path / "one-slow.yaml")
    result = runner.invoke(_app(), ["plan", "collectives", "--cluster", str(path), "--size-mb", "16", "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["busiest_cpu"] == "slow-cpu0"
    assert data["allreduce_cpu_s"] > data["allreduce_links_s"]
    assert data["allreduce_s"] == pytest.approx(data["allreduce_cpu_s"], rel=0.05)
    result = runner.invoke(_app(), ["plan", "collectives", "--cluster", str(path), "--size-mb", "16"])
    assert result.exit_code == 0, result.stderr
    text = " ".join(result.stderr.split())
    assert "the trees are bound by their pieces' CPU" in text and "at slow-cpu0" in text


def test_on_gpus_the_reader_is_told_that_nccl_sums_not_the_trees():
    """A felactl job on GPUs runs NCCL's allreduce (the trees stream over gloo only): the command
    that shows a fragment's trees 4.7x the best ring also shows what the job will run, NCCL's one
    ring over the fragment (closed by a PCIe hop), 7.5 GB/s of allreduce, and its time for the size
    asked; over the whole server, NVLink's four rings."""
    result = runner.invoke(_app(), ["plan", "collectives", "--cluster", DGX, "--devices", "0,1,5", "--size-mb", "100"])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())  # (the console wraps long lines)
    assert "NCCL's allreduce, not these trees" in said and "1 ring(s), 7.50 GB/s" in said
    assert "NCCL 13.365 ms" in said
    data = json.loads(runner.invoke(_app(), ["plan", "collectives", "--cluster", DGX, "--json"]).stdout)
    assert sorted(r["gbps"] for r in data["nccl_rings"]) == [25.0, 25.0, 50.0, 50.0]
    assert data["nccl_allreduce_gbps"] == pytest.approx(150 * 8 / 14)


def test_cpu_slots_are_not_told_about_nccl(tmp_path):
    from felactl.spec import load_cluster, save
    from tests.planner_fixtures import as_cpu_slots

    path = save(as_cpu_slots(load_cluster(DGX)), tmp_path / "slots.yaml")
    result = runner.invoke(_app(), ["plan", "collectives", "--cluster", str(path), "--devices", "0,1,5", "--json"])
    assert result.exit_code == 0, result.output
    assert "nccl_rings" not in json.loads(result.stdout)


def test_the_printed_bound_is_the_trees_own_roots(tmp_path):
    from felactl.optimizer.graph import capacity_graph, min_cut_bound
    from felactl.spec import save
    from tests.graph_fixtures import random_strong_graph

    cluster = random_strong_graph(30)  # the trees packed for the allreduce grow from g2 (12.5), not g0 (25)
    path = save(cluster, tmp_path / "c.yaml")
    result = runner.invoke(_app(), ["plan", "collectives", "--cluster", str(path), "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    graph = capacity_graph(cluster, cluster.device_names)
    own = {root: min_cut_bound(graph, root)[0] for root in data["roots"]}
    assert data["root_bounds_gbps"] == pytest.approx(own)
    assert data["bound_gbps"] == pytest.approx(own[data["root"]])
    shown = runner.invoke(_app(), ["plan", "collectives", "--cluster", str(path)])
    assert f"min-cut bound {own[data['root']]:.2f} GB/s" in " ".join(shown.stderr.split())


def test_no_allreduce_can_beat_what_the_servers_nics_carry(tmp_path):
    import dataclasses

    from felactl.spec import save
    from tests.planner_fixtures import cluster

    spec = cluster([[("g", 10.0, 16.0)] * 2] * 2, intra_gbps=50.0, inter_gbps=10.0)
    spec = dataclasses.replace(spec, nodes=tuple(dataclasses.replace(n, nic_gbps=10.0) for n in spec.nodes))
    path = save(spec, tmp_path / "c.yaml")
    shown = runner.invoke(_app(), ["plan", "collectives", "--cluster", str(path)])
    assert shown.exit_code == 0, shown.stderr
    # each server sends and receives 10 GB/s through its NIC: 40 GB/s of links between them count 10
    assert "no allreduce can beat 10.00 GB/s here" in " ".join(shown.stderr.split())
