"""``felactl plan`` through typer's CliRunner: JSON keys, the plan file, errors with exit 2."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.optimizer import ilp
from felactl.optimizer.evaluate import token_samples
from felactl.spec import load_model, load_plan, save
from tests.planner_fixtures import cluster, model

ROOT = Path(__file__).resolve().parents[1]
DGX1V = str(ROOT / "plans" / "clusters" / "dgx1v.yaml")
VGG = str(ROOT / "plans" / "models" / "vgg-mini.yaml")


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


VGG_ON_THREE = ["plan", "--cluster", DGX1V, "--model", VGG, "--global-batch", "64", "--devices", "0,1,2"]


def test_json_has_the_promised_keys(runner):
    result = runner.invoke(app, [*VGG_ON_THREE, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("iteration_s", "samples_per_s", "solve_s", "status", "baselines", "collectives"):
        assert key in data
    assert data["status"] == "Optimal"
    assert set(data["baselines"]) >= {"dp", "mp", "hp", "no_trees"}
    assert data["samples_per_s"] == pytest.approx(64 / data["iteration_s"])
    # Under bsp, DP as DDP runs it is in the plan's space: never worse. (Under the default sync,
    # tokens, each micro-batch is a claim DDP does not pay, and a millisecond step can lose.)
    bsp = runner.invoke(app, [*VGG_ON_THREE, "--sync", "bsp", "--json"])
    assert bsp.exit_code == 0, bsp.output
    data = json.loads(bsp.stdout)
    assert data["iteration_s"] <= data["baselines"]["dp"] + 5e-10  # (baselines are rounded to 9 decimals)
    # vgg-mini's millisecond steps on three V100s: the tokens plan loses to DDP, and says what to do
    told = runner.invoke(app, VGG_ON_THREE)
    assert told.exit_code == 0, told.output
    assert "predicted faster" in told.output and "--sync bsp" in told.output
    for coll in data["collectives"]:
        assert set(coll) >= {"devices", "root", "trees", "rate_gbps", "bound_gbps", "ring_gbps"}
        assert all(set(t) == {"edges", "weight"} for t in coll["trees"])
    assert set(data["devices"]) <= {"gpu0", "gpu1", "gpu2"}


def test_a_near_optimal_solve_shows_its_status_and_gap(runner, monkeypatch):
    # The ILP stops once its best plan is within HELD_GAP of a round's lower bound, as "near
    # optimal" (tests/test_ilp.py); the user sees it in --json's status and gap and in the
    # summary's solver line.
    solve = ilp.solve
    monkeypatch.setattr(
        ilp, "solve", lambda *a, **k: dataclasses.replace(solve(*a, **k), status="near optimal", gap=5e-4)
    )
    result = runner.invoke(app, [*VGG_ON_THREE, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["status"], data["gap"]) == ("near optimal", 5e-4)
    assert "solver near optimal in" in runner.invoke(app, VGG_ON_THREE).output


def test_writes_a_plan_that_loads_and_shows_compare_and_explain(runner, tmp_path):
    out = tmp_path / "plan.yaml"
    result = runner.invoke(
        app,
        [
            "plan",
            "--cluster",
            DGX1V,
            "--model",
            VGG,
            "--global-batch",
            "64",
            "--devices",
            "gpu0,gpu3,gpu4",
            "-o",
            str(out),
            "--compare",
            "--explain",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    assert plan.global_batch == 64 and plan.predicted.baselines["dp"] > 0
    assert "speedup" in result.output and "one iteration" in result.output


@pytest.mark.parametrize("how", ["--debug", "FELACTL_DEBUG=1"])
def test_debug_writes_the_lp_file(runner, tmp_path, monkeypatch, how):
    """``--debug`` and ``FELACTL_DEBUG=1`` are one switch (the environment one wrote no .lp file)."""
    out = tmp_path / "p.yaml"
    if how == "--debug":
        debug = ["--debug"]
    else:
        debug = []
        monkeypatch.setenv("FELACTL_DEBUG", "1")
    result = runner.invoke(
        app,
        [
            *debug,
            "plan",
            "--cluster",
            DGX1V,
            "--model",
            VGG,
            "--global-batch",
            "16",
            "--devices",
            "0,1",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "c1_start" in (tmp_path / "p.lp").read_text()


def test_sdpipe_gives_static_pipelines(runner, tmp_path):
    spec = cluster([[("g", 10.0, 8.0), ("g", 10.0, 8.0)], [("g", 10.0, 8.0), ("g", 10.0, 8.0)]])
    net = model([(300_000_000, 16_000, 6e8), (50_000, 400, 5e8), (250_000_000, 400, 4e8)])
    save(spec, tmp_path / "c.yaml")
    save(net, tmp_path / "m.yaml")
    result = runner.invoke(
        app,
        [
            "plan",
            "--cluster",
            str(tmp_path / "c.yaml"),
            "--model",
            str(tmp_path / "m.yaml"),
            "--global-batch",
            "32",
            "--sync",
            "sdpipe",
            "-o",
            str(tmp_path / "p.yaml"),
        ],
    )
    assert result.exit_code == 0, result.output
    plan = load_plan(tmp_path / "p.yaml")
    assert plan.schedule.value == "1f1b" and len(plan.pipelines) >= 1
    used = [d for st in plan.stages for d in st.devices]
    assert len(used) == len(set(used))  # each device runs one stage


def test_a_model_that_fits_nowhere_exits_2_naming_memory(runner, tmp_path):
    save(cluster([[("g", 10.0, 2.0)]]), tmp_path / "c.yaml")  # 0.8 GB usable after the headroom
    save(model([(1000, 100, 1e6), (100_000_000, 100, 1e8)]), tmp_path / "m.yaml")
    result = runner.invoke(
        app, ["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", str(tmp_path / "m.yaml"), "--global-batch", "8"]
    )
    assert result.exit_code == 2
    assert "memory" in result.output and "'l1'" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--global-batch", "0"], "--global-batch must be >= 1"),
        (["--global-batch", "8", "--devices", ","], "--devices"),
        (["--global-batch", "8", "--devices", "gpu9"], "gpu9"),
        (["--global-batch", "8", "--sync", "async"], "--sync"),
        (["--global-batch", "8", "--time-limit", "0"], "--time-limit"),
    ],
)
def test_bad_input_exits_2_with_one_line(runner, args, needle):
    result = runner.invoke(app, ["plan", "--cluster", DGX1V, "--model", VGG, *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


def test_missing_options_exit_2(runner):
    result = runner.invoke(app, ["plan", "--cluster", DGX1V])
    assert result.exit_code == 2 and "--model" in result.output


def test_plan_collectives_is_still_a_subcommand(runner):
    result = runner.invoke(app, ["plan", "collectives", "--cluster", DGX1V, "--devices", "0,1,2", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["devices"] == ["gpu0", "gpu1", "gpu2"]


def test_a_plan_that_syncs_cpu_slots_without_a_measured_sync_says_how_to_measure_it(runner, tmp_path):
    import dataclasses

    from felactl.spec import SyncTiming
    from tests.planner_fixtures import two_cpu_slot_cluster

    cluster_path = two_cpu_slot_cluster(tmp_path)
    net = model([(1_000_000, 1000, 1e9), (1_000_000, 1000, 1e9)])
    plain = save(net, tmp_path / "model.yaml")
    args = ["plan", "--cluster", str(cluster_path), "--global-batch", "64", "--sync", "bsp", "--json"]
    result = runner.invoke(app, [*args, "--model", str(plain)])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["stages"][0]["workers"]) == 2  # data parallel over both slots
    assert "--cluster" in result.stderr and "measures it" in result.stderr
    measured = save(
        dataclasses.replace(
            net,
            data_parallel_sync=(
                SyncTiming(cluster="here", devices=("cpu0", "cpu1"), backend="gloo", micro_batch=32, sync_ms=1.0),
            ),
        ),
        tmp_path / "measured.yaml",
    )
    result = runner.invoke(app, [*args, "--model", str(measured)])
    assert result.exit_code == 0 and "measures it" not in result.stderr, result.output


def test_a_device_no_timing_prices_is_named(runner, tmp_path):
    """The slots are "cpu"; a profile timed only on a testbed's "cpu @ 0.1 cores"-like other CPU
    prices them from FLOPs: the plan says which and what to profile. A profile of their CPU says
    nothing."""
    import dataclasses

    from felactl.spec import LayerTiming
    from tests.planner_fixtures import two_cpu_slot_cluster

    cluster_path = two_cpu_slot_cluster(tmp_path)
    base = model([(1_000_000, 1000, 1e9), (1_000_000, 1000, 1e9)])

    def timed_on(device_model: str):
        timing = (LayerTiming(device_model=device_model, micro_batch=32, fwd_ms=1.0, bwd_ms=2.0),)
        return dataclasses.replace(base, layers=tuple(dataclasses.replace(l, timings=timing) for l in base.layers))

    args = ["plan", "--cluster", str(cluster_path), "--global-batch", "64", "--sync", "bsp"]
    other = save(timed_on("Other CPU @ 0.1 cores"), tmp_path / "other.yaml")
    result = runner.invoke(app, [*args, "--model", str(other)])
    assert result.exit_code == 0, result.output
    told = " ".join(result.stderr.split())
    assert (
        "cpu0, cpu1 are priced from FLOPs" in told
        and "timings of Other CPU @ 0.1 cores only" in told
        and "--testbed" in told
    ), told
    own = save(timed_on("cpu @ 0.5 cores"), tmp_path / "own.yaml")  # their CPU, under another quota
    result = runner.invoke(app, [*args, "--model", str(own)])
    assert result.exit_code == 0 and "priced from FLOPs" not in result.stderr, result.output


@pytest.mark.parametrize("where, needle", [("dir", "is a directory"), ("file/plan.yaml", "is not a directory")])
def test_an_output_path_that_cannot_be_a_file_exits_2(runner, tmp_path, where, needle):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("")
    net = save(model([(1000, 10, 1e6)]), tmp_path / "m.yaml")
    result = runner.invoke(
        app, ["plan", "--cluster", DGX1V, "--model", str(net), "--global-batch", "8", "-o", str(tmp_path / where)]
    )
    assert result.exit_code == 2 and needle in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["dp", "mp", "hp"])
def test_a_baseline_plan_is_runnable_and_predicts_what_compare_prints(runner, tmp_path, name):
    args = ["plan", "--cluster", DGX1V, "--model", VGG, "--global-batch", "64", "--devices", "gpu0,gpu3,gpu4"]
    solved = runner.invoke(app, [*args, "--json"])
    assert solved.exit_code == 0, solved.output
    compared = json.loads(solved.stdout)["baselines"][name]
    out = tmp_path / f"{name}.yaml"
    result = runner.invoke(app, [*args, "--baseline", name, "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["solver"] == f"baseline:{name}"
    assert data["iteration_s"] == pytest.approx(compared, abs=1e-9)  # the plan records baselines to 1e-9 s
    plan = load_plan(out)
    assert plan.predicted.iteration_s == pytest.approx(compared, abs=1e-9)
    assert plan.sync.mode.value == "bsp" and not plan.sync.use_trees and not plan.collectives
    checked = runner.invoke(app, ["check", str(out)])
    assert checked.exit_code == 0, checked.output
    if name == "dp":
        (stage,) = plan.stages
        assert (stage.layer_start, stage.layer_end) == (0, load_model(VGG).num_layers)
        # equal shares, dealt in whole micro-batch tokens (as the cost model priced them)
        equal = token_samples(tuple((w.device, 1 / 3) for w in stage.workers), 64, stage.micro_batch)
        assert [w.share * 64 for w in stage.workers] == pytest.approx(list(equal.values()))
    if name == "hp":
        assert len(plan.stages) == 2 and len(plan.stages[1].workers) == 1


def test_a_baseline_without_a_plan_or_with_another_sync_exits_2(runner):
    args = ["plan", "--cluster", DGX1V, "--model", VGG, "--global-batch", "64"]
    one = runner.invoke(app, [*args, "--devices", "gpu0", "--baseline", "hp"])
    assert one.exit_code == 2 and "needs two devices" in one.output
    assert runner.invoke(app, [*args, "--baseline", "zz"]).exit_code == 2
    tokens = runner.invoke(app, [*args, "--baseline", "dp", "--sync", "tokens"])
    assert tokens.exit_code == 2 and "bsp" in tokens.output


def test_explain_shows_a_small_stages_memory_to_three_figures(runner, tmp_path):
    """Stages of 11.7 and 11.1 MB both read "0.01" GB, which said nothing where a device holds
    15 MB (a user's trial with capped CPU slots)."""
    data = Path(__file__).resolve().parent / "data"
    out = tmp_path / "p.yaml"
    args = ["plan", "--cluster", str(data / "two-servers-0.82.cluster.yaml"), "--model"]
    args += [str(data / "llama-two-servers-0.82.model.yaml"), "--global-batch", "64", "--explain", "-o", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    memory = [max(w.predicted_memory_gb for w in st.workers) for st in load_plan(out).stages]
    assert all(m < 0.01 for m in memory)
    for m in memory:
        assert f"{m:.3g}" in result.output


def test_plan_says_it_cuts_the_model_because_no_replica_fits(runner, tmp_path):
    """A user's trial: the reason a plan pipelines (data parallel does not fit) showed only with
    --compare; the summary now says it."""
    data = Path(__file__).resolve().parent / "data"
    args = ["plan", "--cluster", str(data / "two-servers-0.82.cluster.yaml"), "--model"]
    args += [str(data / "llama-two-servers-0.82.model.yaml"), "--global-batch", "64", "-o", str(tmp_path / "p.yaml")]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "note: the model is cut into stages as no whole replica fits a device (dp does not fit: needs " in said, said
