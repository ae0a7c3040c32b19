"""benchmarks/ on a user's own TrainJob (``--job examples.lm:job``): the config flags, the cases,
and a DDP baseline that trains exactly what felactl's bsp trains."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from felactl.spec import SyncMode

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from benchjob import job_config  # noqa: E402


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_runtime = _load("bench_runtime")
bench_scale = _load("bench_scale")
LM = "examples.lm:job"
TINY = {"seq_len": 16, "width": 32, "depth": 1, "num_heads": 2}


@pytest.fixture
def lm_only(monkeypatch):
    """bench_runtime as ``--job examples.lm:job`` leaves it (its own copy of the models)."""
    monkeypatch.setattr(bench_runtime, "MODELS", dict(bench_runtime.MODELS))
    monkeypatch.setenv(bench_runtime.JOB_ENV, json.dumps({"source": LM, "config": TINY}))
    monkeypatch.setenv(bench_runtime.BATCH_ENV, "8")
    bench_runtime._apply_overrides()


def test_job_config_takes_key_values_and_mappings():
    assert job_config(["seq_len=64", '{"width": 128, "depth": 2}', "lr=0.003"]) == {
        "seq_len": 64,
        "width": 128,
        "depth": 2,
        "lr": 3e-3,
    }
    with pytest.raises(SystemExit, match="key=value"):
        job_config(["width"])
    with pytest.raises(SystemExit, match="mapping"):
        job_config(["{not a mapping"])


def test_a_job_replaces_the_builtins_and_a_one_layer_model_has_no_hybrid(lm_only):
    assert bench_runtime.MODELS == {LM: (LM, TINY, 8)}
    args = bench_runtime.argparse.Namespace(
        workers=2,
        factor=3.0,
        tables=[1, 2],
        straggler_models=[LM],
        pattern_models=LM,
        roundrobin_s=0.05,
        prob=0.1,
        prob_s=0.3,
    )
    cases = bench_runtime.cases(args)
    assert [c["name"] for c in cases if c["table"] == 2] == [
        "ddp (torchrun)",
        "bsp",
        "tokens",
        "tokens",
        "wbsp",
        "wbsp overlap",
        "sdpipe",
    ]
    assert {c["model"] for c in cases} == {LM}


def test_the_scale_benchmark_plans_a_job_in_each_sync_mode():
    for sync in ("bsp", "tokens"):
        plan = bench_scale.job_plan(LM, TINY, 2, sync)
        assert (plan.model.source, plan.sync.mode, plan.global_batch) == (LM, SyncMode(sync), 16)


@pytest.mark.multiprocess
def test_the_ddp_baseline_trains_what_felactl_bsp_trains(lm_only, tmp_path, no_leftovers):
    """The job's data, loss, AdamW, warmup + cosine schedule and clipping, in both: after the
    same steps the parameters agree."""
    steps = 3
    ddp = bench_runtime.run_ddp(LM, 2, steps)
    plan = bench_runtime.make_plan(LM, 2, "bsp", 4)
    bench_runtime.run_felactl(tmp_path, "bsp", plan, steps, {})
    ours = json.loads((tmp_path / "bsp" / "workers" / "rank0.json").read_text())["param_checksum"]
    assert ddp["param_checksum"] == pytest.approx(ours, rel=1e-5, abs=1e-4)
