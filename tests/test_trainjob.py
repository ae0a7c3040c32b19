"""felactl.TrainJob: validation, the examples (one README command each), data-parallel-only
models, and the LM example's distributed training equal to single-process training."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _worker_helpers import final_params, reference_params, run_plan
from planner_fixtures import cluster, model
from torch import nn
from typer.testing import CliRunner

from felactl import TrainJob, models
from felactl.cli.main import app
from felactl.errors import InputError, PlanInfeasible, SpecError
from felactl.optimizer.planner import make_plan
from felactl.spec import SyncMode, SyncSpec, check_plan_against_model, load_model, save

ROOT = Path(__file__).resolve().parents[1]
LM_SMALL = {
    "seq_len": 16,
    "width": 32,
    "depth": 1,
    "num_heads": 2,
    "warmup": 2,
    "total_steps": 6,
    "max_grad_norm": 0.05,
}
runner = CliRunner()


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("model", "not a module", "TrainJob.model: must be an nn.Module"),
        ("dataset", iter([1, 2]), "TrainJob.dataset: must be a map-style dataset"),
        ("loss_fn", 3, "TrainJob.loss_fn: must be callable"),
        ("optimizer", "adamw", "TrainJob.optimizer: must be a factory"),
        ("max_grad_norm", -1.0, "TrainJob.max_grad_norm: must be a number > 0"),
        ("precision", "fp16", "TrainJob.precision: must be one of fp32, bf16"),
        ("evaluate", "val", "TrainJob.evaluate: must be callable"),
        ("evaluate_every", 0, "TrainJob.evaluate_every: must be a whole number of steps >= 1"),
    ],
)
def test_a_bad_field_is_named(field, value, words):
    fields = {"model": nn.Linear(2, 2), "dataset": [(torch.zeros(2), 0)], "loss_fn": nn.functional.cross_entropy}
    with pytest.raises(InputError, match=words):
        TrainJob(**{**fields, field: value})


@pytest.mark.parametrize(
    "args",
    [
        ["launch", "--job", "examples.lm:job", "--config", "widht=8", "--nproc-per-node", "2", "--global-batch", "8"],
        ["profile", "--model", "examples.lm:job", "--config", "widht=8"],
    ],
)
def test_a_typo_in_a_jobs_config_exits_2(args, monkeypatch):
    monkeypatch.chdir(ROOT)
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "unknown config key 'widht'; it takes seq_len, width" in result.output


def test_a_model_that_is_no_sequential_is_one_layer_and_profiles_unsplittable(monkeypatch):
    from felactl.profiling.model import profile_model

    monkeypatch.chdir(ROOT)
    bundle = models.build("examples.lm:job", LM_SMALL)
    assert not bundle.splittable and len(bundle.layers) == 1
    assert bundle.stage_module(0, 1) is bundle.job.model  # its checkpoint keys are the model's own
    spec = profile_model("examples.lm:job", LM_SMALL, [2], repeats=1)
    assert not spec.splittable and spec.num_layers == 1
    assert models.build("examples.cnn:job").splittable


def test_the_planner_cuts_only_a_splittable_model(tmp_path):
    # Two 1.6 GB layers on 9 GB devices (x4 with grads and AdamW; 7.1 GB usable after the
    # headroom): only a cut between them fits.
    spec = cluster([[("g", 10.0, 9.0), ("g", 10.0, 9.0)]])
    net = model([(400_000_000, 1000, 8e8), (400_000_000, 1000, 8e8)])
    plan = make_plan(spec, net, 8, sync="bsp", time_limit_s=10)
    assert len(plan.stages) == 2
    whole = dataclasses.replace(net, splittable=False)
    with pytest.raises(PlanInfeasible, match="memory"):
        make_plan(spec, whole, 8, sync="bsp", time_limit_s=10)
    with pytest.raises(SpecError, match="stages: 2 stages, but model 'm' cannot be split"):
        check_plan_against_model(plan, whole)
    small = model([(1000, 1000, 1e6), (1000, 1000, 1e6)])
    assert len(make_plan(spec, dataclasses.replace(small, splittable=False), 8, sync="bsp").stages) == 1
    assert load_model(save(whole, tmp_path / "model.yaml")).splittable is False


def test_a_model_profile_without_splittable_loads_as_splittable(tmp_path):
    path = save(model([(10, 10, 10.0)]), tmp_path / "model.yaml")
    path.write_text("".join(line for line in path.read_text().splitlines(True) if "splittable" not in line))
    assert load_model(path).splittable is True


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["bsp", "tokens"])
def test_the_lm_example_on_2_workers_equals_single_process_training(mode, tmp_path, monkeypatch):
    """AdamW, the warmup + cosine scheduler and clipping (at 0.05, so every step clips)."""
    monkeypatch.chdir(ROOT)
    steps = 4
    plan = models.local_data_parallel_plan(
        "examples.lm:job", LM_SMALL, 2, global_batch=8, micro_batch=2, sync=SyncSpec(mode=SyncMode(mode))
    )
    run_dir = run_plan(plan, tmp_path, steps)
    expected = reference_params(plan, steps)
    # Summing the micro-batches' gradients in another order (per worker, then across workers) moves
    # them by float32 rounding, and AdamW's first steps divide by sqrt(v): after 4 steps the
    # parameters differ by up to 7e-6 even with the split fixed (tokens also moves the split).
    atol = 5e-5
    assert torch.allclose(final_params(run_dir, steps), expected, atol=atol, rtol=0)
    unclipped = dataclasses.replace(
        plan, model=dataclasses.replace(plan.model, config={**LM_SMALL, "max_grad_norm": 1e9})
    )
    clipping_effect = (reference_params(unclipped, steps) - expected).abs().max()
    assert clipping_effect > 10 * atol, "clipping took effect (AdamW damps it) far beyond the rounding allowed"
    state = torch.load(run_dir / "checkpoints" / f"step{steps:06d}" / "stage0.pt", weights_only=False)
    assert state["lr_scheduler"]["last_epoch"] == steps


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["wbsp", "sdpipe"])
def test_the_lm_example_at_its_own_pace_learns_with_its_schedule_on_global_steps(mode, tmp_path, monkeypatch):
    """Worker 1 is 3x slower, so worker 0 makes about three local steps for each of its: the LR
    schedule still follows the global steps (batches of samples), not a worker's own count."""
    monkeypatch.chdir(ROOT)
    steps = 30
    config = {**LM_SMALL, "warmup": 5, "total_steps": steps, "max_grad_norm": 1.0}
    plan = models.local_data_parallel_plan(
        "examples.lm:job", config, 2, global_batch=16, micro_batch=4, sync=SyncSpec(mode=SyncMode(mode))
    )
    run_dir = run_plan(plan, tmp_path, steps, env={"FELACTL_SLOWDOWN": "1=3"})
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["rank"] == 0]
    if mode == "wbsp":  # the fast worker made more local steps than there are global ones; under SDPipe
        assert len(records) > steps + 2  # it also waits for its group partners, so it may make about as many
    losses = [r["loss"] for r in records]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    checksums = {json.loads((run_dir / "workers" / f"rank{w}.json").read_text())["param_checksum"] for w in (0, 1)}
    assert len(checksums) == 1
    state = torch.load(run_dir / "checkpoints" / f"step{steps:06d}" / "stage0.pt", weights_only=False)
    assert steps - 2 <= state["lr_scheduler"]["last_epoch"] <= steps


@pytest.mark.multiprocess
def test_the_cnn_example_trains_with_its_readme_command_and_exports(tmp_path):
    runs = tmp_path / "runs"
    command = [
        sys.executable,
        "-m",
        "felactl",
        "launch",
        "--job",
        "examples.cnn:job",
        "--nproc-per-node",
        "2",
        "--global-batch",
        "32",
        "--steps",
        "40",
        "--runs-root",
        str(runs),
        "--json",
        "--tensorboard",
        str(tmp_path / "tb"),
    ]
    done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert summary["steps"] == 40 and summary["first_loss"] > 1.2 and summary["final_loss"] < 0.3
    assert [p.name for p in runs.iterdir()] == [summary["run"]]  # no plan file shared by every --job launch
    records = [json.loads(line) for line in (runs / summary["run"] / "metrics.jsonl").read_text().splitlines()]
    evaluated = [(r["rank"], r["step"]) for r in records if "eval" in r]  # its evaluate hook, every 10 steps
    assert evaluated == [(0, 9), (0, 19), (0, 29), (0, 39)]
    accuracy = [r["eval"]["val_accuracy"] for r in records if "eval" in r]
    assert accuracy[-1] > 0.8 and accuracy[-1] > accuracy[0], accuracy  # on images it never trained on
    assert all(r["lr"] == 0.05 for r in records)
    from felactl.control.metrics import step_losses
    from tests.test_report import tensorboard_scalars

    scalars = tensorboard_scalars(tmp_path / "tb")  # what --tensorboard wrote, as TensorBoard reads it
    assert [s for s, _ in scalars["train/loss"]] == list(range(40))
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(list(step_losses(records).values()), rel=1e-6)
    assert [s for s, _ in scalars["eval/val_accuracy"]] == [9, 19, 29, 39]
    exported = runner.invoke(app, ["export", summary["run"], "--runs-root", str(runs), "--json"])
    assert exported.exit_code == 0, exported.output
    from examples.cnn import job

    job().model.load_state_dict(torch.load(json.loads(exported.stdout)["output"]))  # strict


def test_the_readme_minimal_job_file_is_short_and_builds(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Bring your own model") :]
    code = section[section.index("```python\n") + len("```python\n") : section.index("```\n", 10)]
    assert len(code.strip().splitlines()) <= 25
    (tmp_path / "felactl_readme_net.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        bundle = models.build("felactl_readme_net:job", {"hidden": 16})
    finally:
        sys.modules.pop("felactl_readme_net", None)
    inputs, targets = bundle.data.batch(range(4))
    assert inputs.shape == (4, 8) and bundle.loss(bundle.model(inputs), targets).item() > 0


@pytest.mark.parametrize(
    "value,words",
    [
        ("nan", "takes int, got 'nan'"),
        (".nan", "not a finite number"),
        ("abc", "takes int, got 'abc'"),
        ("8.5", "takes int"),
    ],
)
@pytest.mark.parametrize("command", ["launch", "profile"])
def test_a_config_value_the_jobs_function_cannot_take_exits_2(command, value, words, monkeypatch):
    """``width: int = 16`` in the job's signature: ``--config width=nan`` (read as the string
    'nan') is refused before any worker starts, as ``.nan`` and a float are (they started the
    workers, which failed deep in torch: exit 1; and profile wrote the config into model.yaml)."""
    monkeypatch.chdir(ROOT)
    args = ["--job", "examples.lm:job", "--nproc-per-node", "2", "--global-batch", "8"]
    args = args if command == "launch" else ["--model", "examples.lm:job"]
    result = runner.invoke(app, [command, *args, "--config", f"width={value}"])
    assert result.exit_code == 2, result.output
    assert words in result.output and "width" in result.output


def test_the_evaluate_hook_runs_on_rank_0_in_eval_mode_and_its_numbers_are_checked():
    from types import SimpleNamespace

    from felactl.agents.worker.hooks import evaluation

    seen, answers = [], [{"val_loss": torch.tensor(0.5), "acc": 1}]

    def evaluate(model, step):
        seen.append((model.training, torch.is_grad_enabled(), step))
        return answers[-1]

    net = nn.Linear(2, 2)
    job = TrainJob(model=net, dataset=[0], loss_fn=lambda o, t: o, evaluate=evaluate, evaluate_every=5)
    one_stage = SimpleNamespace(stages=[SimpleNamespace(shard=False)])
    trainer = SimpleNamespace(job=job, plan=one_stage, runtime=SimpleNamespace(rank=0))
    assert evaluation(trainer, 3) == {}  # not an evaluate_every-th step
    done = evaluation(trainer, 4)
    assert done["eval"] == {"val_loss": 0.5, "acc": 1.0} and seen == [(False, False, 4)] and net.training
    assert evaluation(SimpleNamespace(job=job, plan=one_stage, runtime=SimpleNamespace(rank=1)), 4) == {}
    for answer, words in (
        ([1.0], "must return {name: number}"),
        ({"x": float("nan")}, "'x' is nan"),
        ({"x": "a"}, "'x'"),
    ):
        answers.append(answer)
        with pytest.raises(InputError, match=words):
            evaluation(trainer, 9)
    answers.append(None)
    assert evaluation(trainer, 9)["eval"] == {}
    split = SimpleNamespace(stages=[SimpleNamespace(shard=False)] * 2)
    with pytest.raises(
        InputError, match=r"TrainJob.evaluate: runs on one worker that holds the whole model; .*2 stage"
    ):
        evaluation(SimpleNamespace(job=job, plan=split, runtime=SimpleNamespace(rank=0)), 4)
