"""Bad files through the CLI: exit 2 and exactly one line naming the file and the key path.

``felactl check`` loads any felactl file, so it shows the error every command would give.
(typer's CliRunner keeps stderr apart from stdout here: ``result.stderr`` / ``result.stdout``.)
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable

import pytest
import yaml
from typer.testing import CliRunner

from felactl.cli.main import app

runner = CliRunner()


def _device(name: str, **extra) -> dict:
    return {"name": name, "kind": "cuda", "model": "Tesla V100-SXM2-16GB", "tflops": 14.0, "memory_gb": 16.0, **extra}


CLUSTER = {
    "kind": "Cluster", "schema_version": 1, "name": "lab",
    "nodes": [{"name": "box0", "devices": [_device("a0"), _device("a1")]},
              {"name": "box1", "devices": [_device("b0")]}],
    "links": [{"src": "a0", "dst": "a1", "bandwidth_gbps": 47.5, "latency_us": 2.5, "type": "nvlink"},
              {"src": "a1", "dst": "a0", "bandwidth_gbps": 47.5, "latency_us": 2.5, "type": "nvlink"}],
    "inter_node_default": {"bandwidth_gbps": 1.25, "latency_us": 40.0, "type": "net"},
}

PLAN = {
    "kind": "Plan", "schema_version": 1, "cluster": "lab",
    "model": {"name": "mlp", "source": "mlp"},
    "devices": ["a0", "a1", "b0"], "global_batch": 32, "schedule": "tokens",
    "sync": {"mode": "bsp"},
    "stages": [{"layer_start": 0, "layer_end": 3, "micro_batch": 4,
                "workers": [{"device": "a0", "share": 0.5}, {"device": "a1", "share": 0.5}]},
               {"layer_start": 3, "layer_end": 5, "micro_batch": 8, "workers": [{"device": "b0", "share": 1.0}]}],
    "collectives": [{"group": "stage0", "devices": ["a0", "a1"], "root": "a0",
                     "trees": [{"edges": [["a0", "a1"]], "weight": 47.5}],
                     "rate_gbps": 47.5, "bound_gbps": 47.5, "ring_gbps": 23.75}],
}

MODEL = {
    "kind": "Model", "schema_version": 1, "name": "mlp", "source": "mlp", "input_bytes_per_sample": 1024,
    "layers": [{"name": f"{i}.Linear", "params": 1000, "param_bytes": 4000, "activation_bytes_per_sample": 2048,
                "fwd_flops_per_sample": 2000.0, "bwd_flops_per_sample": 4000.0,
                "timings": [{"device_model": "cpu", "micro_batch": 1, "fwd_ms": 0.1, "bwd_ms": 0.2},
                            {"device_model": "cpu", "micro_batch": 8, "fwd_ms": 0.3, "bwd_ms": 0.6}]}
               for i in range(5)],
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
    ("unknown-device-key", "cluster", lambda d: d["nodes"][1]["devices"][0].update(gpus=8),
     "nodes[1].devices[0].gpus"),
    ("unknown-link-key", "cluster", lambda d: d["links"][1].update(speed=3), "links[1].speed"),
    ("unknown-default-key", "cluster", lambda d: d["inter_node_default"].update(mtu=9000), "inter_node_default.mtu"),
    ("string-for-number", "cluster", lambda d: d["nodes"][0]["devices"][1].update(tflops="fast"),
     "nodes[0].devices[1].tflops"),
    ("list-for-mapping", "cluster", lambda d: d.update(inter_node_default=[1.25, 40]), "inter_node_default"),
    ("mapping-for-list", "cluster", lambda d: d.update(nodes={"box0": {}}), "nodes"),
    ("list-for-device", "cluster", lambda d: d["nodes"][0]["devices"].__setitem__(0, ["a0", "cuda"]),
     "nodes[0].devices[0]"),
    ("bool-for-int", "cluster", lambda d: d["nodes"][0]["devices"][0].update(local_index=True),
     "nodes[0].devices[0].local_index"),
    ("float-for-int", "cluster", lambda d: d["links"][0].update(num_links=1.5), "links[0].num_links"),
    ("missing-memory", "cluster", lambda d: d["nodes"][0]["devices"][0].pop("memory_gb"),
     "nodes[0].devices[0].memory_gb"),
    ("missing-name", "cluster", lambda d: d.pop("name"), "name"),
    ("negative-memory", "cluster", lambda d: d["nodes"][1]["devices"][0].update(memory_gb=-4),
     "nodes[1].devices[0].memory_gb"),
    ("zero-bandwidth", "cluster", lambda d: d["links"][0].update(bandwidth_gbps=0), "links[0].bandwidth_gbps"),
    ("negative-bandwidth", "cluster", lambda d: d["inter_node_default"].update(bandwidth_gbps=-1),
     "inter_node_default.bandwidth_gbps"),
    ("negative-latency", "cluster", lambda d: d["links"][1].update(latency_us=-0.5), "links[1].latency_us"),
    ("nan-tflops", "cluster", lambda d: d["nodes"][0]["devices"][0].update(tflops=float("nan")),
     "nodes[0].devices[0].tflops"),
    ("inf-bandwidth", "cluster", lambda d: d["links"][0].update(bandwidth_gbps=float("inf")),
     "links[0].bandwidth_gbps"),
    ("duplicate-device", "cluster", _dup_device_name, "nodes[1].devices[0].name"),
    ("duplicate-node", "cluster", lambda d: d["nodes"][1].update(name="box0"), "nodes[1].name"),
    ("empty-node", "cluster", lambda d: d["nodes"][1].update(devices=[]), "nodes[1].devices"),
    ("link-to-unknown", "cluster", lambda d: d["links"][1].update(dst="z9"), "links[1].dst"),
    ("self-link", "cluster", lambda d: d["links"][0].update(dst="a0"), "links[0].dst"),
    ("duplicate-link", "cluster", lambda d: d["links"].append(dict(d["links"][0])), "links[2]"),
    ("unknown-link-type", "cluster", lambda d: d["links"][0].update(type="infiniband"), "links[0].type"),
    ("unknown-device-kind", "cluster", lambda d: d["nodes"][0]["devices"][1].update(kind="tpu"),
     "nodes[0].devices[1].kind"),
    ("null-required", "cluster", lambda d: d["nodes"][0]["devices"][0].update(model=None),
     "nodes[0].devices[0].model"),
    ("plan-gap-between-stages", "plan", lambda d: d["stages"][1].update(layer_start=4), "stages[1].layer_start"),
    ("plan-empty-stage", "plan", lambda d: d["stages"][0].update(layer_end=0), "stages[0].layer_end"),
    ("plan-shares-not-1", "plan", lambda d: d["stages"][0]["workers"][1].update(share=0.3), "stages[0].workers"),
    ("plan-share-over-1", "plan", lambda d: d["stages"][1]["workers"][0].update(share=1.5),
     "stages[1].workers[0].share"),
    ("plan-device-not-listed", "plan", lambda d: d["stages"][1]["workers"][0].update(device="c0"),
     "stages[1].workers[0].device"),
    ("plan-idle-device", "plan", lambda d: d["devices"].append("c0"), "devices"),
    ("plan-device-twice", "plan", lambda d: d["devices"].append("a0"), "devices"),
    ("plan-pipeline-too-short", "plan", lambda d: (_pipelined(d), d["pipelines"][1].pop()), "pipelines[1]"),
    ("plan-pipeline-wrong-device", "plan", lambda d: (_pipelined(d), d["pipelines"][0].__setitem__(1, "a1")),
     "pipelines[0][1]"),
    ("plan-1f1b-without-pipelines", "plan", lambda d: d.update(schedule="1f1b"), "pipelines"),
    ("plan-unknown-sync", "plan", lambda d: d["sync"].update(mode="async"), "sync.mode"),
    ("plan-unknown-schedule", "plan", lambda d: d.update(schedule="pipedream"), "schedule"),
    ("plan-bad-token-policy", "plan", lambda d: d["sync"].update(token_policy="fifo"), "sync.token_policy"),
    ("plan-zero-micro-batch", "plan", lambda d: d["stages"][0].update(micro_batch=0), "stages[0].micro_batch"),
    ("plan-root-outside-group", "plan", lambda d: d["collectives"][0].update(root="b0"), "collectives[0].root"),
    ("plan-collective-outside-plan", "plan",
     lambda d: d["collectives"][0].update(devices=["a0", "a1", "c7"]), "collectives[0].devices[2]"),
    ("plan-tree-leaves-group", "plan", lambda d: d["collectives"][0]["trees"][0]["edges"][0].__setitem__(1, "b0"),
     "collectives[0].trees[0].edges[0]"),
    ("plan-edge-of-three", "plan", lambda d: d["collectives"][0]["trees"][0]["edges"][0].append("a1"),
     "collectives[0].trees[0].edges[0]"),
    ("plan-model-missing-source", "plan", lambda d: d["model"].pop("source"), "model.source"),
    ("plan-unknown-optimizer", "plan", lambda d: d.update(training={"optimizer": "adam"}), "training.optimizer"),
    ("model-duplicate-layer", "model", lambda d: d["layers"][3].update(name="1.Linear"), "layers[3].name"),
    ("model-negative-params", "model", lambda d: d["layers"][2].update(params=-1), "layers[2].params"),
    ("model-zero-activation", "model", lambda d: d["layers"][4].update(activation_bytes_per_sample=0),
     "layers[4].activation_bytes_per_sample"),
    ("model-negative-saved", "model", lambda d: d["layers"][1].update(saved_bytes_per_sample=-8),
     "layers[1].saved_bytes_per_sample"),
    ("model-duplicate-timing", "model", lambda d: d["layers"][0]["timings"][1].update(micro_batch=1),
     "layers[0].timings[1]"),
    ("model-negative-time", "model", lambda d: d["layers"][1]["timings"][0].update(bwd_ms=-0.2),
     "layers[1].timings[0].bwd_ms"),
    ("model-no-layers", "model", lambda d: d.update(layers=[]), "layers"),
    ("model-config-list", "model", lambda d: d.update(config=["depth", 4]), "config"),
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
    ("unknown-kind", "kind: Widget\nschema_version: 1\n", "kind: must be one of Cluster|Model|Plan, got 'Widget'"),
    ("nan-literal", yaml.safe_dump(CLUSTER).replace("tflops: 14.0", "tflops: .nan", 1), "tflops: must be a finite"),
    ("not-utf8", b"kind: Cluster\nname: \xff\xfe\n", "cannot read"),
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


@pytest.mark.parametrize("args, needle", [
    (["profile", "--batch-sizes", "4"], "--batch-sizes is for profiling a model: add --model NAME"),
    (["profile", "--batch-sizes", "1,4,16,64"], "--batch-sizes is for profiling a model"),  # even the default
    (["profile", "--config", "depth=3"], "--config is for profiling a model"),
    (["profile", "--model", "mlp", "--worker-batch", "4"], "--worker-batch is for --cluster"),
    (["plan", "--cluster", "c.yaml", "--model", "m.yaml", "--global-batch", "0"], "--global-batch must be >= 1"),
    (["scale", "r", "--add", "1", "--timeout", "0"], "--timeout must be > 0"),
    (["agent", "--rdzv-endpoint", "127.0.0.1:1", "--secret-file", "s", "--join-timeout", "0"],
     "--join-timeout must be > 0"),
    (["profile", "--timeout", "0"], "--timeout must be > 0"),
    (["profile", "--message-bytes", "-1"], "--message-bytes must be >= 4"),
    (["profile", "--matmul-size", "0"], "--matmul-size must be >= 1"),
    (["profile", "--nnodes", "0"], "--nnodes must be >= 1"),
    (["profile", "--hostfile", "nope", "--rdzv-endpoint", "127.0.0.1:1"], "no such hostfile"),
])
def test_flags_that_cannot_work_exit_2_with_one_line(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not list(tmp_path.iterdir())  # nothing written
