"""Bad files through the CLI: exit 2 and exactly one line naming the file and the key path.

``felactl check`` loads any felactl file, so it shows the error every command would give.
(typer's CliRunner keeps stderr apart from stdout here: ``result.stderr`` / ``result.stdout``.)
"""

from __future__ import annotations

import copy
import json
import typing
from collections.abc import Callable
from typing import Any

import pytest
import typer
import yaml
from typer.testing import CliRunner

from felactl.cli.main import app

runner = CliRunner()


def _device(name: str, **extra) -> dict:
    return {"name": name, "kind": "cuda", "model": "Tesla V100-SXM2-16GB", "tflops": 14.0, "memory_gb": 16.0, **extra}


CLUSTER = {
    "kind": "Cluster",
    "schema_version": 1,
    "name": "lab",
    "nodes": [
        {"name": "box0", "devices": [_device("a0"), _device("a1")]},
        {"name": "box1", "devices": [_device("b0")]},
    ],
    "links": [
        {"src": "a0", "dst": "a1", "bandwidth_gbps": 47.5, "latency_us": 2.5, "type": "nvlink"},
        {"src": "a1", "dst": "a0", "bandwidth_gbps": 47.5, "latency_us": 2.5, "type": "nvlink"},
    ],
    "inter_node_default": {"bandwidth_gbps": 1.25, "latency_us": 40.0, "type": "net"},
}

PLAN = {
    "kind": "Plan",
    "schema_version": 1,
    "cluster": "lab",
    "model": {"name": "mlp", "source": "mlp"},
    "devices": ["a0", "a1", "b0"],
    "global_batch": 32,
    "schedule": "tokens",
    "sync": {"mode": "bsp"},
    "stages": [
        {
            "layer_start": 0,
            "layer_end": 3,
            "micro_batch": 4,
            "workers": [{"device": "a0", "share": 0.5}, {"device": "a1", "share": 0.5}],
        },
        {"layer_start": 3, "layer_end": 5, "micro_batch": 8, "workers": [{"device": "b0", "share": 1.0}]},
    ],
    "collectives": [
        {
            "group": "stage0",
            "devices": ["a0", "a1"],
            "root": "a0",
            "trees": [{"edges": [["a0", "a1"]], "weight": 47.5}],
            "rate_gbps": 47.5,
            "bound_gbps": 47.5,
            "ring_gbps": 23.75,
        }
    ],
}

MODEL = {
    "kind": "Model",
    "schema_version": 1,
    "name": "mlp",
    "source": "mlp",
    "input_bytes_per_sample": 1024,
    "layers": [
        {
            "name": f"{i}.Linear",
            "params": 1000,
            "param_bytes": 4000,
            "activation_bytes_per_sample": 2048,
            "fwd_flops_per_sample": 2000.0,
            "bwd_flops_per_sample": 4000.0,
            "timings": [
                {"device_model": "cpu", "micro_batch": 1, "fwd_ms": 0.1, "bwd_ms": 0.2},
                {"device_model": "cpu", "micro_batch": 8, "fwd_ms": 0.3, "bwd_ms": 0.6},
            ],
        }
        for i in range(5)
    ],
}

BASES = {"cluster": CLUSTER, "plan": PLAN, "model": MODEL}


def _pipelined(d: dict) -> None:
    d["schedule"] = "1f1b"
    d["pipelines"] = [["a0", "b0"], ["a1", "b0"]]


def _dup_device_name(d: dict) -> None:
    d["nodes"][1]["devices"][0]["name"] = "a1"


# (id, base, change to the base dict, key path the one-line message must name)
MUTATIONS: list[tuple[str, str, Callable[[dict], Any], str]] = [
    ("cluster-wrong-kind", "cluster", lambda d: d.update(kind="Clustr"), "kind"),
    ("cluster-no-kind", "cluster", lambda d: d.pop("kind"), "kind"),
    ("cluster-schema-2", "cluster", lambda d: d.update(schema_version=2), "schema_version"),
    ("cluster-schema-string", "cluster", lambda d: d.update(schema_version="1"), "schema_version"),
    ("unknown-top-key", "cluster", lambda d: d.update(nodez=[]), "nodez"),
    ("unknown-device-key", "cluster", lambda d: d["nodes"][1]["devices"][0].update(gpus=8), "nodes[1].devices[0].gpus"),
    ("unknown-link-key", "cluster", lambda d: d["links"][1].update(speed=3), "links[1].speed"),
    ("unknown-default-key", "cluster", lambda d: d["inter_node_default"].update(mtu=9000), "inter_node_default.mtu"),
    (
        "string-for-number",
        "cluster",
        lambda d: d["nodes"][0]["devices"][1].update(tflops="fast"),
        "nodes[0].devices[1].tflops",
    ),
    ("list-for-mapping", "cluster", lambda d: d.update(inter_node_default=[1.25, 40]), "inter_node_default"),
    ("mapping-for-list", "cluster", lambda d: d.update(nodes={"box0": {}}), "nodes"),
    (
        "list-for-device",
        "cluster",
        lambda d: d["nodes"][0]["devices"].__setitem__(0, ["a0", "cuda"]),
        "nodes[0].devices[0]",
    ),
    (
        "bool-for-int",
        "cluster",
        lambda d: d["nodes"][0]["devices"][0].update(local_index=True),
        "nodes[0].devices[0].local_index",
    ),
    ("float-for-int", "cluster", lambda d: d["links"][0].update(num_links=1.5), "links[0].num_links"),
    (
        "missing-memory",
        "cluster",
        lambda d: d["nodes"][0]["devices"][0].pop("memory_gb"),
        "nodes[0].devices[0].memory_gb",
    ),
    ("missing-name", "cluster", lambda d: d.pop("name"), "name"),
    (
        "negative-memory",
        "cluster",
        lambda d: d["nodes"][1]["devices"][0].update(memory_gb=-4),
        "nodes[1].devices[0].memory_gb",
    ),
    ("zero-bandwidth", "cluster", lambda d: d["links"][0].update(bandwidth_gbps=0), "links[0].bandwidth_gbps"),
    (
        "negative-bandwidth",
        "cluster",
        lambda d: d["inter_node_default"].update(bandwidth_gbps=-1),
        "inter_node_default.bandwidth_gbps",
    ),
    ("negative-latency", "cluster", lambda d: d["links"][1].update(latency_us=-0.5), "links[1].latency_us"),
    (
        "nan-tflops",
        "cluster",
        lambda d: d["nodes"][0]["devices"][0].update(tflops=float("nan")),
        "nodes[0].devices[0].tflops",
    ),
    (
        "inf-bandwidth",
        "cluster",
        lambda d: d["links"][0].update(bandwidth_gbps=float("inf")),
        "links[0].bandwidth_gbps",
    ),
    ("duplicate-device", "cluster", _dup_device_name, "nodes[1].devices[0].name"),
    ("duplicate-node", "cluster", lambda d: d["nodes"][1].update(name="box0"), "nodes[1].name"),
    ("empty-node", "cluster", lambda d: d["nodes"][1].update(devices=[]), "nodes[1].devices"),
    ("link-to-unknown", "cluster", lambda d: d["links"][1].update(dst="z9"), "links[1].dst"),
    ("self-link", "cluster", lambda d: d["links"][0].update(dst="a0"), "links[0].dst"),
    ("duplicate-link", "cluster", lambda d: d["links"].append(dict(d["links"][0])), "links[2]"),
    ("unknown-link-type", "cluster", lambda d: d["links"][0].update(type="infiniband"), "links[0].type"),
    (
        "unknown-device-kind",
        "cluster",
        lambda d: d["nodes"][0]["devices"][1].update(kind="tpu"),
        "nodes[0].devices[1].kind",
    ),
    ("null-required", "cluster", lambda d: d["nodes"][0]["devices"][0].update(model=None), "nodes[0].devices[0].model"),
    ("plan-gap-between-stages", "plan", lambda d: d["stages"][1].update(layer_start=4), "stages[1].layer_start"),
    ("plan-empty-stage", "plan", lambda d: d["stages"][0].update(layer_end=0), "stages[0].layer_end"),
    ("plan-shares-not-1", "plan", lambda d: d["stages"][0]["workers"][1].update(share=0.3), "stages[0].workers"),
    (
        "plan-share-over-1",
        "plan",
        lambda d: d["stages"][1]["workers"][0].update(share=1.5),
        "stages[1].workers[0].share",
    ),
    (
        "plan-device-not-listed",
        "plan",
        lambda d: d["stages"][1]["workers"][0].update(device="c0"),
        "stages[1].workers[0].device",
    ),
    ("plan-idle-device", "plan", lambda d: d["devices"].append("c0"), "devices"),
    ("plan-device-twice", "plan", lambda d: d["devices"].append("a0"), "devices"),
    ("plan-pipeline-too-short", "plan", lambda d: (_pipelined(d), d["pipelines"][1].pop()), "pipelines[1]"),
    (
        "plan-pipeline-wrong-device",
        "plan",
        lambda d: (_pipelined(d), d["pipelines"][0].__setitem__(1, "a1")),
        "pipelines[0][1]",
    ),
    ("plan-1f1b-without-pipelines", "plan", lambda d: d.update(schedule="1f1b"), "pipelines"),
    ("plan-unknown-sync", "plan", lambda d: d["sync"].update(mode="async"), "sync.mode"),
    ("plan-unknown-schedule", "plan", lambda d: d.update(schedule="pipedream"), "schedule"),
    ("plan-bad-token-policy", "plan", lambda d: d["sync"].update(token_policy="fifo"), "sync.token_policy"),
    ("plan-zero-micro-batch", "plan", lambda d: d["stages"][0].update(micro_batch=0), "stages[0].micro_batch"),
    ("plan-root-outside-group", "plan", lambda d: d["collectives"][0].update(root="b0"), "collectives[0].root"),
    (
        "plan-collective-outside-plan",
        "plan",
        lambda d: d["collectives"][0].update(devices=["a0", "a1", "c7"]),
        "collectives[0].devices[2]",
    ),
    (
        "plan-tree-leaves-group",
        "plan",
        lambda d: d["collectives"][0]["trees"][0]["edges"][0].__setitem__(1, "b0"),
        "collectives[0].trees[0].edges[0]",
    ),
    (
        "plan-edge-of-three",
        "plan",
        lambda d: d["collectives"][0]["trees"][0]["edges"][0].append("a1"),
        "collectives[0].trees[0].edges[0]",
    ),
    ("plan-model-missing-source", "plan", lambda d: d["model"].pop("source"), "model.source"),
    ("plan-unknown-optimizer", "plan", lambda d: d.update(training={"optimizer": "adam"}), "training.optimizer"),
    ("model-duplicate-layer", "model", lambda d: d["layers"][3].update(name="1.Linear"), "layers[3].name"),
    ("model-negative-params", "model", lambda d: d["layers"][2].update(params=-1), "layers[2].params"),
    (
        "model-zero-activation",
        "model",
        lambda d: d["layers"][4].update(activation_bytes_per_sample=0),
        "layers[4].activation_bytes_per_sample",
    ),
    (
        "model-negative-saved",
        "model",
        lambda d: d["layers"][1].update(saved_bytes_per_sample=-8),
        "layers[1].saved_bytes_per_sample",
    ),
    (
        "model-duplicate-timing",
        "model",
        lambda d: d["layers"][0]["timings"][1].update(micro_batch=1),
        "layers[0].timings[1]",
    ),
    (
        "model-negative-time",
        "model",
        lambda d: d["layers"][1]["timings"][0].update(bwd_ms=-0.2),
        "layers[1].timings[0].bwd_ms",
    ),
    ("model-no-layers", "model", lambda d: d.update(layers=[]), "layers"),
    ("model-config-list", "model", lambda d: d.update(config=["depth", 4]), "config"),
    # What a file may claim is bounded (felactl.limits): no machine has 1e308 GB.
    (
        "memory-1e308",
        "cluster",
        lambda d: d["nodes"][0]["devices"][1].update(memory_gb=1e308),
        "nodes[0].devices[1].memory_gb: must be at most 100000 (100 TB",
    ),
    ("host-memory-1e308", "cluster", lambda d: d["nodes"][0].update(memory_gb=1e308), "nodes[0].memory_gb"),
    (
        "tflops-1e-300",
        "cluster",
        lambda d: d["nodes"][1]["devices"][0].update(tflops=1e-300),
        "nodes[1].devices[0].tflops: must be >= 1e-06",
    ),
    ("bandwidth-1e300", "cluster", lambda d: d["links"][0].update(bandwidth_gbps=1e300), "links[0].bandwidth_gbps"),
    (
        "latency-1e300",
        "cluster",
        lambda d: d["inter_node_default"].update(latency_us=1e300),
        "inter_node_default.latency_us",
    ),
    ("num-links-huge", "cluster", lambda d: d["links"][0].update(num_links=10**40), "links[0].num_links"),
    ("plan-global-batch-1e40", "plan", lambda d: d.update(global_batch=10**40), "global_batch: must be at most 131072"),
    ("plan-micro-batch-huge", "plan", lambda d: d["stages"][1].update(micro_batch=2**40), "stages[1].micro_batch"),
    (
        "model-flops-1e300",
        "model",
        lambda d: d["layers"][2].update(fwd_flops_per_sample=1e300),
        "layers[2].fwd_flops_per_sample",
    ),
    ("model-params-huge", "model", lambda d: d["layers"][0].update(params=10**30), "layers[0].params"),
    (
        "model-time-1e300",
        "model",
        lambda d: d["layers"][1]["timings"][0].update(fwd_ms=1e300),
        "layers[1].timings[0].fwd_ms",
    ),
    (
        "model-no-flops-at-all",
        "model",
        lambda d: [layer.update(fwd_flops_per_sample=0, bwd_flops_per_sample=0) for layer in d["layers"]],
        "layers: every layer has 0 FLOPs",
    ),
]


def _check(*args: str):
    result = runner.invoke(app, ["check", *args])
    assert "Traceback" not in result.output
    return result


def _assert_one_line_error(result, file_name: str, key_path: str | None) -> str:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("felactl: error: ") and file_name in line
    if key_path is not None:
        assert f"{file_name}: {key_path}" in line, line
    return line


@pytest.mark.parametrize("case", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_bad_value_names_file_and_key(case, tmp_path, monkeypatch):
    _case_id, base, mutate, key_path = case
    data = copy.deepcopy(BASES[base])
    mutate(data)
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{base}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    line = _assert_one_line_error(_check(f"{base}.yaml"), f"{base}.yaml", key_path)
    assert len(line) < 300


@pytest.mark.parametrize("base", BASES)
def test_valid_bases_pass(base, tmp_path, monkeypatch):
    """The mutations above start from files that are valid: each failure is the mutation's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{base}.yaml").write_text(yaml.safe_dump(BASES[base], sort_keys=False))
    result = _check(f"{base}.yaml", "--json")
    assert result.exit_code == 0, result.output
    [summary] = json.loads(result.stdout)["files"]
    assert summary["kind"] == BASES[base]["kind"]


def test_the_documented_example_message(tmp_path, monkeypatch):
    data = copy.deepcopy(CLUSTER)
    data["nodes"][1]["devices"][0]["memory_gb"] = -4
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(data))
    result = _check("cluster.yaml")
    assert result.stderr == "felactl: error: cluster.yaml: nodes[1].devices[0].memory_gb: must be > 0, got -4\n"


# (id, raw file text, words the message must contain)
RAW_FILES = [
    ("malformed-yaml", "kind: Cluster\nnodes: [a, b\n", "not valid YAML"),
    ("tab-indented", "kind: Cluster\nnodes:\n\t- name: a\n", "not valid YAML"),
    ("duplicate-yaml-key", "kind: Cluster\nschema_version: 1\nname: a\nname: b\nnodes: []\n", "duplicate key 'name'"),
    ("empty-file", "", "empty"),
    ("only-a-comment", "# nothing here\n", "empty"),
    ("top-level-list", "- kind: Cluster\n", "must be a mapping"),
    ("top-level-scalar", "hello\n", "must be a mapping"),
    (
        "unknown-kind",
        "kind: Widget\nschema_version: 1\n",
        "kind: must be one of Cluster|Model|Plan|Testbed, got 'Widget'",
    ),
    ("nan-literal", yaml.safe_dump(CLUSTER).replace("tflops: 14.0", "tflops: .nan", 1), "tflops: must be a finite"),
    ("not-utf8", b"kind: Cluster\nname: \xff\xfe\n", "cannot read"),
    # PyYAML bounds neither: a billion-laughs alias bomb (a 10**9-item string list under a key whose
    # error message printed it) and nesting deep enough to overflow its recursive composer.
    (
        "alias-bomb",
        yaml.safe_dump(CLUSTER)
        + "description:\n  - &a0 lol\n"
        + "".join(f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10)),
        "values once its aliases are expanded",
    ),
    ("deep-nesting", "kind: Cluster\nnodes: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested deeper than 64"),
]


@pytest.mark.parametrize("case", RAW_FILES, ids=[c[0] for c in RAW_FILES])
def test_bad_file_is_one_line(case, tmp_path, monkeypatch):
    _case_id, content, words = case
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "bad.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = _assert_one_line_error(_check("bad.yaml"), "bad.yaml", None)
    assert words in line, line


def test_missing_file_and_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "no such file" in _assert_one_line_error(_check("nope.yaml"), "nope.yaml", None)
    (tmp_path / "plans").mkdir()
    assert "is a directory" in _assert_one_line_error(_check("plans"), "plans", None)


def test_a_file_that_is_not_a_regular_file_or_too_large(tmp_path, monkeypatch):
    """/dev/zero would be read forever; a file over the size bound is refused before it is parsed."""
    from felactl.spec import io

    monkeypatch.chdir(tmp_path)
    assert "not a regular file" in _assert_one_line_error(_check("/dev/zero"), "/dev/zero", None)
    monkeypatch.setattr(io, "MAX_FILE_BYTES", 1000)
    (tmp_path / "big.yaml").write_text(yaml.safe_dump(CLUSTER) + "#" * 1000)
    assert "larger than" in _assert_one_line_error(_check("big.yaml"), "big.yaml", None)


def test_aliases_within_the_bound_still_load(tmp_path, monkeypatch):
    """Anchors are fine in a hand-written file: only their expansion is bounded."""
    monkeypatch.chdir(tmp_path)
    text = yaml.safe_dump(CLUSTER).replace("inter_node_default:", "inter_node_default: &net", 1)
    (tmp_path / "cluster.yaml").write_text(text + "intra_node_default: *net\n")
    assert _check("cluster.yaml").exit_code == 0


def test_json_mode_keeps_stdout_clean_on_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump({**PLAN, "global_batch": 0}))
    _assert_one_line_error(_check("plan.yaml", "--json"), "plan.yaml", "global_batch")


def test_first_bad_file_of_many_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(CLUSTER))
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**MODEL, "input_bytes_per_sample": -1}))
    _assert_one_line_error(_check("good.yaml", "bad.yaml"), "bad.yaml", "input_bytes_per_sample")


def test_check_summarises_each_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for base, data in BASES.items():
        (tmp_path / f"{base}.yaml").write_text(yaml.safe_dump(data))
    result = _check("cluster.yaml", "model.yaml", "plan.yaml")
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "cluster.yaml: Cluster 'lab', 2 nodes, 3 devices, 2 links (+ default links)",
        "model.yaml: Model 'mlp', 5 layers, 5,000 params, timed on 1 device model",
        "plan.yaml: Plan of 'mlp' on 'lab', 2 stages, 3 devices, schedule tokens, sync bsp, global batch 32",
    ]
    summary = json.loads(_check("--json", "cluster.yaml").stdout)["files"][0]
    assert (summary["num_nodes"], summary["num_devices"], summary["num_links"]) == (2, 3, 2)


def test_exponent_numbers_read_as_numbers(tmp_path, monkeypatch):
    """PyYAML alone reads ``1e9`` and ``2.5e3`` as strings; felactl files accept them as numbers."""
    monkeypatch.chdir(tmp_path)
    text = yaml.safe_dump(MODEL, sort_keys=False).replace("fwd_flops_per_sample: 2000.0", "fwd_flops_per_sample: 2e3")
    (tmp_path / "model.yaml").write_text(text.replace("bwd_flops_per_sample: 4000.0", "bwd_flops_per_sample: 4.0e3"))
    assert _check("model.yaml").exit_code == 0
    (tmp_path / "model.yaml").write_text(text.replace("params: 1000", "params: 1e3", 1))
    _assert_one_line_error(_check("model.yaml"), "model.yaml", "layers[0].params: must be an integer, got 1000.0")


def test_a_plan_given_where_a_cluster_is_expected(tmp_path):
    """The library loaders check kind first, so a swapped file says so instead of 'unknown key'."""
    from felactl.errors import SpecError
    from felactl.spec import load_cluster

    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(PLAN))
    with pytest.raises(SpecError, match=r"plan.yaml: kind: must be Cluster, got 'Plan'"):
        load_cluster(tmp_path / "plan.yaml")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["profile", "--batch-sizes", "4"], "--batch-sizes is for profiling a model: add --model NAME"),
        (["profile", "--batch-sizes", "1,4,16,64"], "--batch-sizes is for profiling a model"),  # even the default
        (["profile", "--config", "depth=3"], "--config is for profiling a model"),
        # typed, not valued: an empty value went on to profile the cluster
        (["profile", "--batch-sizes", ""], "--batch-sizes is for profiling a model"),
        (["profile", "--model", "mlp", "--worker-batch", "4"], "--worker-batch is for --cluster"),
        # The other direction: a cluster's flags given with --model were silently ignored (review of issue 31).
        (
            ["profile", "--model", "mlp", "--hostfile", "hosts"],
            "--hostfile is for profiling a cluster, not with --model",
        ),
        (["profile", "--model", "mlp", "--rdzv-endpoint", "127.0.0.1:1"], "--rdzv-endpoint is for profiling a cluster"),
        (["profile", "--model", "mlp", "--nnodes", "1"], "--nnodes is for profiling a cluster"),  # even the default
        (["profile", "--model", "mlp", "--nproc-per-node", "2"], "--nproc-per-node is for profiling a cluster"),
        (["profile", "--model", "mlp", "--secret-file", "s"], "--secret-file is for profiling a cluster"),
        (["profile", "--model", "mlp", "--log-dir", "logs"], "--log-dir is for profiling a cluster"),
        (["profile", "--model", "mlp", "--name", "c"], "--name is for profiling a cluster"),
        (["profile", "--model", "mlp", "--join-timeout", "5"], "--join-timeout is for profiling a cluster"),
        (["profile", "--model", "mlp", "--message-bytes", "64"], "--message-bytes is for profiling a cluster"),
        (["profile", "--model", "mlp", "--gpu-matmul-size", "64"], "--gpu-matmul-size is for profiling a cluster"),
        (["plan", "--cluster", "c.yaml", "--model", "m.yaml", "--global-batch", "0"], "--global-batch must be >= 1"),
        (["scale", "r", "--add", "1", "--timeout", "0"], "--timeout must be > 0"),
        (
            ["agent", "--rdzv-endpoint", "127.0.0.1:1", "--secret-file", "s", "--join-timeout", "0"],
            "--join-timeout must be > 0",
        ),
        (["profile", "--timeout", "0"], "--timeout must be > 0"),
        (["profile", "--message-bytes", "-1"], "--message-bytes must be >= 4"),
        (["profile", "--matmul-size", "0"], "--matmul-size must be >= 1"),
        (["profile", "--nnodes", "0"], "--nnodes must be >= 1"),
        (["profile", "--hostfile", "nope", "--rdzv-endpoint", "127.0.0.1:1"], "no such hostfile"),
        # Found by the fuzz test of issue 11: each hung, failed inside, or was accepted.
        (
            ["plan", "--cluster", "c.yaml", "--model", "m.yaml", "--global-batch", str(10**40)],
            "--global-batch must be at most 131072",
        ),
        (
            ["plan", "--cluster", "c.yaml", "--model", "m.yaml", "--global-batch", "8", "--time-limit", "nan"],
            "--time-limit must be a finite number, got nan",
        ),
        (["profile", "--model", "mlp", "--batch-sizes", "4,1000000000000"], "--batch-sizes must be at most 131072"),
        (["profile", "--model", "mlp", "--batch-sizes", ""], "--batch-sizes: expected comma-separated integers"),
        (["profile", "--matmul-size", "100000000"], "--matmul-size must be at most 32768"),
        # A flag that only --job reads was silently ignored with a plan (review of issue 12).
        (["launch", "plan.yaml", "--global-batch", "64"], "--global-batch: only with --job"),
        (["launch", "plan.yaml", "--micro-batch", "4"], "--micro-batch: only with --job"),
        (["launch", "plan.yaml", "--config", "depth=2"], "--config: only with --job"),
        (["launch", "plan.yaml", "--heartbeat-timeout", "nan"], "--heartbeat-timeout must be a finite number"),
        (["launch", "plan.yaml", "--collective-timeout", "inf"], "--collective-timeout must be a finite number"),
        (["launch", "plan.yaml", "--max-batch", str(10**12)], "--max-batch must be at most 131072"),
        (["launch", "plan.yaml", "--straggler", "prob:0.5:nan"], "SECONDS must be a finite number"),
        (["launch", "plan.yaml", "--slowdown", "1=inf"], "FACTOR must be a finite number >= 1"),
        (["scale", "r", "--to", "1000000000"], "--to must be at most 65536"),
        (["scale", "r", "--add", "1", "--timeout", "nan"], "--timeout must be a finite number"),
        (
            ["agent", "--rdzv-endpoint", "127.0.0.1:1", "--secret-file", "s", "--join-timeout", "-inf"],
            "--join-timeout must be a finite number",
        ),
        (["plan", "collectives", "--cluster", "c.yaml", "--size-mb", "inf"], "--size-mb must be a finite number"),
    ],
)
def test_flags_that_cannot_work_exit_2_with_one_line(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not list(tmp_path.iterdir())  # nothing written


def _bad_summary(run):
    (run / "summary.json").write_text('{"steps": 3,')


def _record_without_samples(run):
    (run / "metrics.jsonl").write_text(
        '{"time": 1.0, "rank": 0, "step": 1, "loss": 2.0, "compute_s": 0.1, '
        '"comm_s": 0.0, "wait_s": 0.0, "duration_s": 0.1}\n'
    )


# (id, how the run directory is spoiled, the file named, words the message must contain)
BAD_RUNS = [
    ("invalid-summary", _bad_summary, "summary.json", "not valid JSON"),
    (
        "summary-not-an-object",
        lambda run: (run / "summary.json").write_text("[1, 2]\n"),
        "summary.json",
        "expected a JSON object, got list",
    ),
    ("record-without-samples", _record_without_samples, "metrics.jsonl", "record 1 (rank 0, step 1) has no 'samples'"),
    (
        "record-not-an-object",
        lambda run: (run / "metrics.jsonl").write_text("3\n"),
        "metrics.jsonl",
        "line 1 is not a JSON object",
    ),
    ("metrics-is-a-directory", lambda run: (run / "metrics.jsonl").mkdir(), "metrics.jsonl", "is a directory"),
    ("events-is-a-directory", lambda run: (run / "events.jsonl").mkdir(), "events.jsonl", "is a directory"),
]


@pytest.mark.parametrize("case", BAD_RUNS, ids=[c[0] for c in BAD_RUNS])
@pytest.mark.parametrize("as_json", [False, True], ids=["human", "json"])
def test_status_of_a_spoiled_run_is_one_line(case, as_json, tmp_path, monkeypatch):
    _case_id, spoil, file_name, words = case
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "plan.yaml").write_text(yaml.safe_dump(PLAN))
    spoil(run)
    result = runner.invoke(app, ["status", "r", *(["--json"] if as_json else [])])
    line = _assert_one_line_error(result, f"runs/r/{file_name}", None)
    assert words in line and "internal error" not in line, line


def _commands(command, path=()):
    """(command path, click command) of every command and sub-command of felactl."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


# Arguments that get each command as far as its flag checks (files named need not exist).
_BASE_ARGS = {
    ("plan",): ["--cluster", "c.yaml", "--model", "m.yaml", "--global-batch", "8"],
    ("plan", "collectives"): ["--cluster", "c.yaml"],
    ("launch",): ["plan.yaml"],
    ("scale",): ["r", "--add", "1"],
    ("agent",): ["--rdzv-endpoint", "127.0.0.1:1", "--secret-file", "s"],
    ("testbed", "link"): ["a", "b"],
}


def _takes_a_float(param) -> bool:
    descriptor = getattr(param, "type_descriptor", None)  # typer >= 0.20's own click keeps no .type
    if descriptor is not None:
        return float in (descriptor.annotation, *typing.get_args(descriptor.annotation))
    # an older typer on click (as on the lent GPU machines): click's float types are named so
    return "float" in getattr(getattr(param, "type", None), "name", "")


def test_every_float_flag_refuses_nan_and_inf(tmp_path, monkeypatch):
    """click parses 'nan' and 'inf' as floats, and every comparison with nan is False: a timeout
    of nan was never reached (a hung worker never noticed). Every float flag, today's and
    tomorrow's, must refuse them, naming the flag."""
    import typer.main

    monkeypatch.chdir(tmp_path)
    checked = []
    for path, command in _commands(typer.main.get_command(app)):
        for param in command.params:
            if param.param_type_name != "option" or not _takes_a_float(param):
                continue
            flag = max(param.opts, key=len)
            for value in ("nan", "inf", "-inf"):
                result = runner.invoke(app, [*path, *_BASE_ARGS.get(path, []), flag, value])
                assert result.exit_code == 2, (path, flag, value, result.output)
                assert flag in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr
            checked.append(flag)
    assert {
        "--time-limit",
        "--heartbeat-timeout",
        "--collective-timeout",
        "--timeout",
        "--join-timeout",
        "--size-mb",
        "--min-share",
    } <= set(checked)
    assert not list(tmp_path.iterdir())


def test_launch_refuses_a_runs_root_that_is_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(PLAN))
    (tmp_path / "afile").write_text("")
    for root in ("afile", "afile/runs"):
        result = runner.invoke(app, ["launch", "plan.yaml", "--runs-root", root])
        assert result.exit_code == 2, result.output
        assert result.stderr == f"felactl: error: --runs-root {root}: afile is not a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "plan.yaml"]


def test_plan_refuses_a_device_given_twice(tmp_path, monkeypatch):
    """--devices 0,0 was planned as one device, silently."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(CLUSTER))
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(MODEL))
    for devices, named in (("0,0", "a0"), ("a1,b0,1", "a1")):
        result = runner.invoke(
            app, ["plan", "--cluster", "c.yaml", "--model", "m.yaml", "--global-batch", "8", "--devices", devices]
        )
        assert result.exit_code == 2, result.output
        assert result.stderr == f"felactl: error: --devices: device {named!r} is given twice ({devices!r})\n"


def test_the_planner_refuses_a_global_batch_beyond_the_bound_at_once():
    """The library, not only the flag: 10**40 looped for ever in the DP baseline's token count."""
    import time

    from felactl.errors import InputError
    from felactl.optimizer.planner import make_plan
    from felactl.spec import ClusterSpec, ModelSpec, from_dict

    cluster, model = from_dict(ClusterSpec, CLUSTER), from_dict(ModelSpec, MODEL)
    started = time.perf_counter()
    with pytest.raises(InputError, match=r"global batch must be at most 131072 .* got 100000\.\.\. \(41 digits\)"):
        make_plan(cluster, model, 10**40)
    assert time.perf_counter() - started < 1.0


def test_output_into_a_pipe_closed_early_is_no_internal_error():
    """`felactl profile --help | head -60`: the reader stopped while felactl was still writing. That
    is the reader's choice, not a felactl bug: no "internal error" line (click ends quietly)."""
    from felactl.cli.main import FelactlGroup

    piped = typer.Typer(cls=FelactlGroup)

    @piped.command()
    def talk() -> None:
        raise BrokenPipeError(32, "Broken pipe")

    @piped.command()
    def other() -> None:
        pass

    result = CliRunner().invoke(piped, ["talk"])
    assert result.exit_code == 1 and "internal error" not in result.output, result.output
