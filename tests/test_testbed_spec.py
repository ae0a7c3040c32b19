"""The Testbed format and the ``felactl testbed`` command's refusals: no root needed (the tests that
build testbeds are in test_testbed.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.errors import SpecError
from felactl.spec.io import from_dict
from felactl.testbed import TestbedSpec, load_testbed
from felactl.testbed.shaping import _loss_bytecode

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "plans" / "testbeds").glob("*.yaml"))

BASE = {
    "kind": "Testbed",
    "schema_version": 1,
    "name": "lab",
    "nodes": [{"name": "a", "cpus": 0.5, "cores": [0]}, {"name": "b"}],
    "links": [{"src": "a", "dst": "b", "bandwidth_gbps": 0.02, "latency_us": 100, "loss": 0.01}],
    "default_link": {"bandwidth_gbps": 0.01},
}


def test_shipped_testbeds_load_and_cover_every_pair() -> None:
    assert {p.stem for p in SPECS} >= {"dgx1v-fragment", "two-servers", "one-slow", "asymmetric"}
    for path in SPECS:
        tb = load_testbed(path)
        n = len(tb.nodes)
        assert n >= 3 and len(tb.all_links()) == n * (n - 1)
        assert all(node.cpus is not None and node.cores for node in tb.nodes), path


def test_shipped_testbeds_are_uneven() -> None:
    by_name = {p.stem: load_testbed(p) for p in SPECS}
    widths = {link.bandwidth_gbps for link in by_name["dgx1v-fragment"].all_links()}
    assert len(widths) == 2
    servers = by_name["two-servers"]
    assert servers.link("s0a", "s0b").bandwidth_gbps >= 5 * servers.link("s0a", "s1a").bandwidth_gbps
    cpus = sorted(node.cpus for node in by_name["one-slow"].nodes)
    assert cpus[0] * 3 <= cpus[1] == cpus[-1]
    asym = by_name["asymmetric"]
    assert any(
        asym.link(l.src, l.dst).bandwidth_gbps != asym.link(l.dst, l.src).bandwidth_gbps for l in asym.all_links()
    )


def test_default_link_fills_unlisted_pairs() -> None:
    tb = from_dict(TestbedSpec, copy.deepcopy(BASE), "t.yaml")
    assert tb.link("a", "b").bandwidth_gbps == 0.02 and tb.link("a", "b").loss == 0.01
    assert tb.link("b", "a").bandwidth_gbps == 0.01 and tb.link("b", "a").latency_us == 0


def _with(path: str, value) -> dict:
    data = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    if value is KeyError:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "key", "words"),
    [
        ("nodes.0.color", "red", "nodes[0].color", "unknown key"),
        ("nodes.0.cpus", "half", "nodes[0].cpus", "must be a number"),
        ("nodes.0.cpus", -0.5, "nodes[0].cpus", "must be > 0"),
        ("nodes.0.cpus", 2.0, "nodes[0].cpus", "more than the 1 pinned core"),
        ("nodes.0.cpus", 1e9, "nodes[0].cpus", "must be at most"),
        ("nodes.0.cores", [0, 0], "nodes[0].cores[1]", "listed twice"),
        ("nodes.0.cores", [-1], "nodes[0].cores[0]", "must be >= 0"),
        ("nodes.0.cores", [], "nodes[0].cores", "at least one core"),
        ("nodes.1.name", "a", "nodes[1].name", "duplicate node name"),
        ("nodes.1.name", "B_1", "nodes[1].name", "lower-case"),
        ("links.0.bandwidth_gbps", -1, "links[0].bandwidth_gbps", "must be > 0"),
        ("links.0.bandwidth_gbps", 1e6, "links[0].bandwidth_gbps", "must be at most 100"),
        ("links.0.bandwidth_gbps", float("nan"), "links[0].bandwidth_gbps", "finite"),
        ("links.0.latency_us", -3, "links[0].latency_us", "must be >= 0"),
        ("links.0.latency_us", 1e12, "links[0].latency_us", "must be at most"),
        ("links.0.loss", 1.5, "links[0].loss", "must be at most 1"),
        ("links.0.dst", "c", "links[0].dst", "unknown node"),
        ("links.0.dst", "a", "links[0].dst", "two different nodes"),
        ("default_link", KeyError, "links", "no link b -> a and no default_link"),
        ("kind", "Cluster", "kind", "must be Testbed"),
        ("schema_version", 2, "schema_version", "must be 1"),
    ],
)
def test_bad_testbed_is_one_line_naming_file_and_key(tmp_path, path, value, key, words) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text(yaml.safe_dump(_with(path, value)))
    with pytest.raises(SpecError) as exc:
        load_testbed(spec)
    assert str(exc.value).startswith(f"{spec}: {key}: "), str(exc.value)
    assert words in str(exc.value)
    result = runner.invoke(app, ["testbed", "up", str(spec)])  # refused before it needs root
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"felactl: error: {exc.value}"


def test_too_many_nodes_is_refused(tmp_path) -> None:
    data = copy.deepcopy(BASE)
    data["nodes"] = [{"name": f"n{i}"} for i in range(65)]
    data["links"] = []
    with pytest.raises(SpecError, match=r"nodes: at most 64 nodes"):
        from_dict(TestbedSpec, data, "t.yaml")


def test_cli_refusals_are_one_line_exit_2(tmp_path, monkeypatch) -> None:
    spec = tmp_path / "ok.yaml"
    spec.write_text(yaml.safe_dump(BASE))
    result = runner.invoke(app, ["testbed", "up", str(spec), "--name", "Bad-Name"])
    assert result.exit_code == 2 and "--name 'Bad-Name'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = runner.invoke(app, ["testbed", "up", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2 and "no such file" in result.stderr
    result = runner.invoke(app, ["testbed", "exec", "a"])
    assert result.exit_code == 2 and "give the command to run" in result.stderr
    monkeypatch.setenv("FELACTL_TESTBED_DIR", str(tmp_path / "state"))
    result = runner.invoke(app, ["testbed", "status", "--name", "nothere"])
    assert (
        result.exit_code == 2
        and result.stderr.strip()
        == "felactl: error: no testbed 'nothere' is up (felactl testbed up SPEC --name nothere)"
    )
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    result = runner.invoke(app, ["testbed", "up", str(spec)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "felactl: error: testbed: needs root (network namespaces, tc and cgroups); run it as root"
    ]


def test_help_lists_the_subcommands() -> None:
    result = runner.invoke(app, ["testbed", "--help"])
    assert result.exit_code == 0
    for word in ("up", "down", "status", "exec", "link", "Needs root"):
        assert word in result.stdout


def test_loss_filter_bytecode() -> None:
    """ldh [12]; jeq IPv4; ld [26] (source address); jeq; ld rand; jge threshold; drop / pass."""
    text = _loss_bytecode("198.18.0.2", 0.25)
    count, *ops = text.split(",")
    assert int(count) == len(ops) == 8
    assert ops[0] == "40 0 0 12" and ops[1] == "21 0 5 2048"
    assert ops[2] == "32 0 0 26" and ops[3] == f"21 0 3 {(198 << 24) + (18 << 16) + 2}"
    assert ops[4] == f"32 0 0 {2**32 - 4096 + 56}" and ops[5] == f"53 1 0 {2**30}"
    assert ops[6:] == ["6 0 0 2", f"6 0 0 {2**32 - 1}"]
    cut = _loss_bytecode("198.18.0.2", 1.0).split(",")  # a cut link drops every packet, no dice
    assert cut[0] == "6" and cut[2] == "21 0 3 2048" and cut[4] == f"21 0 1 {(198 << 24) + (18 << 16) + 2}"


def test_profile_and_launch_refuse_testbed_with_other_node_flags(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FELACTL_TESTBED_DIR", str(tmp_path / "state"))
    plan = tmp_path / "plan.yaml"
    plan.write_text("kind: Plan\n")  # never read: the flags are refused first
    cases = [
        (["profile", "--testbed", "tb", "--rdzv-endpoint", "127.0.0.1:1"], "--rdzv-endpoint: not with --testbed"),
        (["profile", "--testbed", "tb", "--nnodes", "3"], "--nnodes: not with --testbed"),
        (["profile", "--testbed", "tb"], "no testbed 'tb' is up"),
        (
            ["launch", str(plan), "--testbed", "tb", "--rdzv-endpoint", "127.0.0.1:1"],
            "--rdzv-endpoint: not with --testbed",
        ),
        (["launch", "--script", str(plan), "--testbed", "tb"], "--testbed: runs a plan's training for now"),
    ]
    for args, words in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.stderr)
        assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)


def test_cpu_period_is_short_but_holds_a_quota_of_a_millisecond() -> None:
    from felactl.testbed.cgroups import cpu_period_us

    assert cpu_period_us(0.25) == 10_000 and cpu_period_us(2.0) == 10_000
    assert cpu_period_us(0.05) == 20_000 and round(0.01 * cpu_period_us(0.01)) >= 1000


def test_the_profiles_latency_pause_lasts_a_testbed_cpu_period() -> None:
    """The pause lets a capped node have its quota back (felactl.profiling.links)."""
    from felactl.profiling.links import LinkProbe
    from felactl.testbed.cgroups import CPU_PERIOD_US

    assert LinkProbe().latency_pause_s * 1e6 >= CPU_PERIOD_US


def test_felactl_check_reads_testbeds(tmp_path) -> None:
    result = runner.invoke(app, ["check", *map(str, SPECS)])
    assert result.exit_code == 0, result.stderr
    assert "Testbed 'two-servers', 4 nodes, 12 directed links" in result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_with("links.0.loss", -0.1)))
    result = runner.invoke(app, ["check", str(bad)])
    assert (
        result.exit_code == 2
        and result.stderr.strip() == f"felactl: error: {bad}: links[0].loss: must be >= 0, got -0.1"
    )
