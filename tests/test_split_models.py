"""Real model classes cut at split points (felactl.models.split): found, traced, profiled per
block, and run as pipelines that train to the single-process result."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from _worker_helpers import hybrid_plan, metrics, pipeline_plan, run_plan, single_process
from torch import nn
from typer.testing import CliRunner

from felactl import models
from felactl.agents.worker.checkpoint import checkpoint_path
from felactl.agents.worker.tied import Tied, check_sharded_ties
from felactl.cli.main import app
from felactl.control.metrics import step_losses
from felactl.errors import InputError
from felactl.launcher.export import merge_stages
from felactl.launcher.resume import load_stage
from felactl.models.split import SplitGraph, SplitStage, default_split_points, find_blocks
from felactl.spec import ModelRef, Schedule, SyncMode, SyncSpec, Training, check_executable
from felactl.spec.executable import why_not_rescalable

ROOT = Path(__file__).resolve().parents[1]
LLAMA = "examples.llama:job"
SMALL = {"seq_len": 16, "width": 32, "depth": 2, "num_heads": 2, "total_steps": 20}
runner = CliRunner()


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))


def _logits(out):
    return out["logits"] if isinstance(out, dict) else getattr(out, "logits", out)


def test_the_block_list_is_found_and_every_block_is_a_split_point():
    job = models.build(LLAMA, SMALL).job
    assert find_blocks(job.model) == "layers"
    assert default_split_points(job.model) == ["layers.0", "layers.1"]
    bundle = models.build(LLAMA, SMALL)
    assert bundle.splittable and bundle.layer_names == ["embedding", "layers.0", "layers.1", "head"]
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) is None
    # a block's own sub-lists (the experts of an MoE block) are not the model's blocks
    experts = [nn.ModuleDict({"experts": nn.ModuleList([nn.Linear(9, 9), nn.Linear(9, 9)])}) for _ in range(2)]
    assert find_blocks(nn.ModuleDict({"blocks": nn.ModuleList(experts)})) == "blocks"


@pytest.mark.parametrize("rope,tied", [(True, True), (False, False)])
def test_the_pieces_chained_are_the_model_at_any_batch_size(rope, tied):
    bundle = models.build(LLAMA, dict(SMALL, rope=rope, tied=tied))
    model = bundle.model
    ids, _ = bundle.job.batch(range(3))  # traced at 2 samples: the batch axis is dynamic
    want = _logits(model(ids))
    want.square().mean().backward()
    want_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    for cuts in ([0, 2, 4], [0, 1, 3, 4]):
        stages = [bundle.stage_module(a, b) for a, b in zip(cuts, cuts[1:])]
        assert all(isinstance(s, SplitStage) for s in stages)
        out = ids
        for stage in stages:
            out = stage(out)
        _logits(out).square().mean().backward()
        assert torch.equal(_logits(out), want)
        assert all(torch.allclose(p.grad, want_grads[k], atol=1e-7) for k, p in model.named_parameters())
        model.zero_grad()
        keys = [k for s in stages for k in s.state_dict()]
        assert set(keys) == set(model.state_dict()), "the stages hold the model's weights, by its names"
        assert len(keys) == len(model.state_dict()) + (2 if tied else 0)  # embed.weight and head.weight twice


def test_split_points_named_in_the_job_cut_there_and_nowhere_else():
    job = models.build(LLAMA, dict(SMALL, depth=3)).job
    mine = dataclasses.replace(job, split_points=["layers.1"])
    inputs, _ = job.batch(range(2))
    graph = SplitGraph(mine.model, inputs, mine.split_points, head=False)
    assert graph.names == ["embedding", "layers.1"]  # before layers.1, and from it to the end
    first, second = (SplitStage(graph, mine.model, a, a + 1) for a in (0, 1))
    assert {k.split(".")[1] for k in first.state_dict() if k.startswith("layers.")} == {"0"}
    assert {k.split(".")[1] for k in second.state_dict() if k.startswith("layers.")} == {"1", "2"}
    assert torch.equal(_logits(second(first(inputs))), _logits(job.model(inputs)))


@pytest.mark.parametrize(
    "points,why",
    [
        (["layers.9"], "'layers.9' is not a submodule"),
        ("layers.1", "must be a list of module paths"),
        (["layers.1", "layers.1"], "names a module twice"),
    ],
)
def test_bad_split_points_are_refused_when_the_job_is_made(points, why):
    job = models.build(LLAMA, SMALL).job
    with pytest.raises(InputError, match=why):
        dataclasses.replace(job, split_points=points)


def test_a_split_point_out_of_the_forwards_order_is_refused():
    job = models.build(LLAMA, dict(SMALL, depth=3)).job
    inputs, _ = job.batch(range(2))
    with pytest.raises(InputError, match="runs again after"):
        SplitGraph(job.model, inputs, ["layers.2", "layers.1"], head=False)


def test_a_model_with_data_dependent_control_flow_is_refused_at_profile():
    result = runner.invoke(app, ["profile", "--model", "_user_models:branching_job", "--batch-sizes", "2"])
    assert result.exit_code == 2, result.output
    assert "cannot trace the model to split it into stages" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_an_hf_model_built_to_generate_is_told_to_drop_its_cache():
    pytest.importorskip("transformers", reason="transformers is a test-only dependency (the dev extra)")
    result = runner.invoke(app, ["profile", "--model", "_hf_models:gpt2_with_cache", "--batch-sizes", "2"])
    assert result.exit_code == 2, result.output
    assert "build the model with use_cache=False" in result.output and len(result.output.strip().splitlines()) == 1


def test_the_profile_has_the_embedding_each_block_and_the_head():
    from felactl.profiling.model import profile_model

    spec = profile_model(LLAMA, SMALL, [2], repeats=1)
    assert spec.splittable and [layer.name for layer in spec.layers] == ["embedding", "layers.0", "layers.1", "head"]
    blocks = spec.layers[1:3]
    assert blocks[0].params == blocks[1].params > 0 and all(b.fwd_flops_per_sample > 0 for b in blocks)
    # a boundary carries the hidden states and the rotary tables the later blocks read
    assert spec.layers[0].activation_bytes_per_sample > SMALL["seq_len"] * SMALL["width"] * 4
    assert spec.layers[0].kind == "Embedding" and blocks[0].kind == "Block"
    assert spec.layers[-1].kind == "RMSNorm+Linear"  # the head, though its weight is the embedding's


def _trained(plan, run_dir: Path, steps: int) -> dict[str, torch.Tensor]:
    """The run's weights after ``steps``, its stages merged as ``felactl export`` merges them."""
    return merge_stages(checkpoint_path(run_dir, steps, 0).parent, plan)


def _step_losses(run_dir: Path) -> list[float]:
    """Each step's loss over its global batch, as the run's summary reads it from the records of
    the workers that computed it (a flexible hybrid's worker may compute the loss of other samples
    than it took in: ``loss_samples``)."""
    return list(step_losses(metrics(run_dir)).values())


def _largest_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _run_pipeline(tmp_path, source, config, cuts, steps, replicas=1):
    plan = pipeline_plan(cuts, replicas, "1f1b", micro_batch=3, global_batch=8, config=config)
    plan = dataclasses.replace(plan, model=ModelRef(name=source, source=source, config=config))
    return plan, run_plan(plan, tmp_path, steps, env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})


@pytest.mark.multiprocess
@pytest.mark.parametrize("cuts", [[0, 2, 4], [0, 1, 3, 4]])
def test_a_llama_shaped_pipeline_trains_to_the_single_process_result(tmp_path, cuts):
    """Tied embedding and head on the first and last stage, rotary tables crossing every
    boundary, a dict output; AdamW, a warmup-cosine schedule and clipping, 20 steps."""
    steps = 20
    plan, run_dir = _run_pipeline(tmp_path, LLAMA, SMALL, cuts, steps)
    want, losses = single_process(plan, steps, micro_batch=plan.stages[0].micro_batch)  # summed as 1F1B sums
    got = _trained(plan, run_dir, steps)
    assert _largest_difference(got, want) < 1e-5

    assert max(abs(a - b) for a, b in zip(_step_losses(run_dir), losses, strict=True)) < 1e-5
    exported = models.build(LLAMA, SMALL).model
    exported.load_state_dict(got, strict=True)  # the user's unsplit model takes the run's weights
    ids, _ = models.build(LLAMA, SMALL).job.batch(range(2))
    reference = models.build(LLAMA, SMALL).model
    reference.load_state_dict(want)
    assert torch.allclose(_logits(exported(ids)), _logits(reference(ids)), atol=1e-5)


@pytest.mark.multiprocess
def test_a_model_whose_blocks_are_a_module_dict_is_cut_at_them_and_trains_as_one_process(tmp_path):
    """torchtitan's layout (``layers`` a ModuleDict keyed "0", "1", ..., the forward over its
    values): its blocks are found, each a split point, and a 2-stage pipeline of it trains to the
    single-process result; the export loads strict into the user's model."""
    source = "_user_models:titan_llama"
    bundle = models.build(source)
    assert find_blocks(bundle.model) == "layers" and default_split_points(bundle.model) == [
        "layers.0",
        "layers.1",
        "layers.2",
    ]
    assert bundle.splittable and bundle.layer_names == ["embedding", "layers.0", "layers.1", "layers.2", "head"]
    plan, run_dir = _run_pipeline(tmp_path, source, {}, [0, 2, 5], 6)
    want, losses = single_process(plan, 6, micro_batch=plan.stages[0].micro_batch)
    assert max(abs(a - b) for a, b in zip(_step_losses(run_dir), losses, strict=True)) < 1e-5
    got = _trained(plan, run_dir, 6)
    assert _largest_difference(got, want) < 1e-5
    models.build(source).model.load_state_dict(got, strict=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("tied", [False, True])
def test_two_pipelines_sum_each_stage_and_a_tied_head_over_stages_too(tmp_path, tied):
    config = dict(SMALL, tied=tied, rope=tied)  # learned positions where untied
    plan, run_dir = _run_pipeline(tmp_path, LLAMA, config, [0, 2, 4], 6, replicas=2)
    want, losses = single_process(plan, 6)
    assert max(abs(a - b) for a, b in zip(_step_losses(run_dir), losses, strict=True)) < 1e-5
    # Sums in another order differ in the last bits; AdamW's update of a weight whose gradients
    # stay near zero magnifies that (one element of 20k moved 1.6e-5 here, all others < 2e-6).
    assert _largest_difference(_trained(plan, run_dir, 6), want) < 5e-5


@pytest.mark.multiprocess
# (untied, both stages sharded: the tied case runs that path and more; one run fewer for the suite's time)
@pytest.mark.parametrize("tied,shard", [(True, (True, True)), (False, (True, False))])
def test_a_pipeline_of_sharded_stages_trains_to_the_single_process_result(tmp_path, tied, shard):
    """2 stages, each sharded over 2 workers (FSDP2 over the stage's workers, one per pipeline):
    each worker holds half of its stage, the pipelines' micro-batches gather the stage's weights
    together, its gradients are reduce-scattered once a step; tied, the head's gradient is summed
    with the embedding's shard by shard. Or stage 0 sharded and stage 1 replicated (its gradients
    all-reduced), as the planner shards only the stages that need it. AdamW, a schedule and
    clipping: one process's result."""
    config = dict(SMALL, tied=tied, rope=tied)
    plan = pipeline_plan([0, 2, 4], 2, "1f1b", micro_batch=2, global_batch=8, config=config)
    plan = dataclasses.replace(
        plan,
        model=ModelRef(name=LLAMA, source=LLAMA, config=config),
        stages=tuple(dataclasses.replace(stage, shard=s) for stage, s in zip(plan.stages, shard, strict=True)),
    )
    check_executable(plan)
    steps = 6
    run_dir = run_plan(plan, tmp_path, steps, env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    want, losses = single_process(plan, steps)
    assert max(abs(a - b) for a, b in zip(_step_losses(run_dir), losses, strict=True)) < 1e-5
    got = _trained(plan, run_dir, steps)
    assert _largest_difference(got, want) < 5e-5  # sums in another order (the replicated test's bound)
    models.build(LLAMA, config).model.load_state_dict(got, strict=True)
    held = [json.loads((run_dir / "workers" / f"rank{r}.json").read_text())["params_held"] for r in range(4)]
    names = dict(models.build(LLAMA, config).model.named_parameters())
    stage0 = sum(names[k].numel() for k in load_stage(checkpoint_path(run_dir, steps, 0))["model"] if k in names)
    assert held[0] + held[2] == stage0 and max(held[0], held[2]) < stage0, f"stage 0 split in two: {held}"
    if not shard[1]:
        assert held[1] == held[3] == sum(p.numel() for p in names.values()) - stage0, f"stage 1 whole on each: {held}"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "source,blocks,kind",
    [
        ("_hf_models:llama", "model.layers", "LlamaDecoderLayer"),
        ("_hf_models:gpt2", "transformer.h", "GPT2Block"),  # learned positions, lm_head tied to wte
    ],
)
def test_a_hugging_face_lm_profiles_per_block_and_trains_as_a_two_stage_pipeline(tmp_path, source, blocks, kind):
    """transformers' own classes, built from a config: profiled per block, cut between them, and
    trained as 2 stages to the single-process weights; GPT-2's head, the token embedding's tensor,
    sits in both stages, its gradient summed over them, and exports as one."""
    pytest.importorskip("transformers", reason="transformers is a test-only dependency (the dev extra)")
    from felactl.profiling.model import profile_model

    config = {"depth": 2}
    spec = profile_model(source, config, [2], repeats=1)
    assert [layer.name for layer in spec.layers] == ["embedding", f"{blocks}.0", f"{blocks}.1", "head"]
    assert spec.layers[1].kind == kind and spec.layers[1].params == spec.layers[2].params
    steps = 4
    plan, run_dir = _run_pipeline(tmp_path, source, config, [0, 2, 4], steps)
    want, _ = single_process(plan, steps)
    got = _trained(plan, run_dir, steps)
    assert _largest_difference(got, want) < 1e-5
    model = models.build(source, config).model
    model.load_state_dict(got, strict=True)
    if source.endswith("gpt2"):
        assert model.lm_head.weight is model.transformer.wte.weight and spec.tied


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "tied,sub_models",
    [
        (False, [(0, 2, 2, [0, 1]), (2, 4, 4, [1])]),
        (True, [(0, 2, 2, [0, 1]), (2, 4, 4, [1])]),
        (True, [(0, 1, 2, [0, 1]), (1, 3, 2, [0, 1]), (3, 4, 4, [1])]),
    ],
    ids=["2-untied", "2-tied", "3-tied"],
)
def test_the_flexible_hybrid_merges_a_split_models_tokens_by_what_each_value_is(tmp_path, tied, sub_models):
    """Tokens of a split model carry hidden states (batched), rotary tables (shared) and the
    batch size (a number): merged two to one at the second sub-model, whose worker set differs,
    the parameters still equal single-process training. Tied: worker 1 runs both the embedding's
    and the head's sub-model (one tensor, stepped once), worker 0 the embedding's only (the
    weight's gradient summed over both). 2 and 3 sub-models; 20 steps of AdamW, its schedule and
    clipping: each step's loss the single process's within 1e-5."""
    config = dict(SMALL, tied=tied)
    plan = hybrid_plan(sub_models, 2, global_batch=8, config=config)
    plan = dataclasses.replace(plan, model=ModelRef(name=LLAMA, source=LLAMA, config=config))
    steps = 20 if tied else 4
    run_dir = run_plan(plan, tmp_path, steps, env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    want, losses = single_process(plan, steps, micro_batch=2)  # the first sub-model's tokens
    assert max(abs(a - b) for a, b in zip(_step_losses(run_dir), losses, strict=True)) < 1e-5
    # Which worker sums which token, and so the float order of each sum, is decided at run time:
    # the replicated pipelines' bound (1.18e-5 was seen against the whole batch on a fast CPU)
    assert _largest_difference(_trained(plan, run_dir, steps), want) < 5e-5


def test_the_values_at_a_cut_are_told_apart_by_how_they_follow_the_batch():
    kinds = models.build(LLAMA, SMALL).boundary_kinds
    # into each block: the hidden states, the batch size (the trace reads it), the two rotary
    # tables; into the head, the hidden states alone
    assert kinds == [["batched", "size", "shared", "shared"]] * 2 + [["batched"]]


def _sharded_plan(config, num_workers=2, shares=None, shard=True):
    plan = models.local_data_parallel_plan(
        LLAMA,
        config,
        num_workers,
        global_batch=8,
        micro_batch=2,
        shares=shares,
        sync=SyncSpec(mode=SyncMode.BSP),
        training=Training(seed=0),
    )
    return dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], shard=shard),))


@pytest.mark.multiprocess
@pytest.mark.parametrize("shard", [True, False])
def test_a_sharded_stage_trains_as_its_replicated_twin_and_exports_whole(tmp_path, shard):
    """FSDP2 over two workers: each holds half of every weight, its gradients and AdamW's moments;
    a tied head, a schedule and clipping; the result equals single-process training, as its
    replicated twin's does (the user's module whole in one stage, not its first piece). Each
    worker checkpoints its own shards; the export reads them whole."""
    steps = 6
    plan = _sharded_plan(SMALL, shard=shard)
    run_dir = run_plan(plan, tmp_path, steps, env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
    want, losses = single_process(plan, steps)
    assert max(abs(a - b) for a, b in zip(_step_losses(run_dir), losses, strict=True)) < 1e-5
    got = _trained(plan, run_dir, steps)
    assert _largest_difference(got, want) < 1e-5
    model = models.build(LLAMA, SMALL).model
    model.load_state_dict(got, strict=True)
    whole = sum(p.numel() for p in model.parameters())
    held = [json.loads((run_dir / "workers" / f"rank{r}.json").read_text())["params_held"] for r in range(2)]
    shards = list(checkpoint_path(run_dir, steps, 0).parent.glob("stage0.*.shards"))
    if shard:
        assert sum(held) == whole and max(held) < whole, f"each worker holds a shard: {held} of {whole}"
        assert len(list(shards[0].glob("*.distcp"))) == 2  # and writes it: nobody gathers the stage
    else:
        assert held == [whole, whole] and not shards


def test_a_sharded_stage_is_refused_where_it_cannot_run():
    plan = _sharded_plan(SMALL)
    check_executable(plan)
    with pytest.raises(InputError, match="nothing to shard over"):
        check_executable(_sharded_plan(SMALL, num_workers=1))
    with pytest.raises(InputError, match="as many micro-batches per step .* these shares give cpu0 3, cpu1 1"):
        check_executable(_sharded_plan(SMALL, shares=[0.75, 0.25]))  # 6 and 2 samples: 3 and 1 micro-batches
    tokens = dataclasses.replace(plan, sync=SyncSpec(mode=SyncMode.TOKENS))
    with pytest.raises(InputError, match="sync tokens cannot run"):
        check_executable(tokens)
    assert "sharded stage" in why_not_rescalable(plan)


def _sharded_pipeline(replicas=2, sync="bsp", shard=(True, True)):
    plan = pipeline_plan([0, 2, 4], replicas, "1f1b", micro_batch=2, global_batch=8, config=SMALL, sync=sync)
    stages = tuple(dataclasses.replace(stage, shard=s) for stage, s in zip(plan.stages, shard))
    return dataclasses.replace(plan, model=ModelRef(name=LLAMA, source=LLAMA, config=SMALL), stages=stages)


def test_a_sharded_stage_of_a_pipeline_is_refused_where_it_cannot_run():
    check_executable(_sharded_pipeline())
    check_executable(_sharded_pipeline(sync="tokens"))  # a static pipeline's stages sum as BSP
    with pytest.raises(InputError, match=r"stages\[0\].shard: a stage of one worker has nothing to shard over"):
        check_executable(_sharded_pipeline(replicas=1))
    with pytest.raises(InputError, match="sync sdpipe averages whole replicas .* use sync bsp or tokens"):
        check_executable(_sharded_pipeline(sync="sdpipe"))
    flexible = dataclasses.replace(_sharded_pipeline(), schedule=Schedule.TOKENS, pipelines=())
    with pytest.raises(InputError, match="token scheduling gives workers unequal micro-batch counts"):
        check_executable(flexible)
    mixed = _sharded_pipeline(shard=(True, False))
    with pytest.raises(
        InputError, match="the tied weight 'embed.weight' is on stage 0 .sharded., stage 1 .replicated."
    ):
        check_sharded_ties(mixed, [Tied("embed.weight", (0, 1))])
    check_sharded_ties(_sharded_pipeline(), [Tied("embed.weight", (0, 1))])


@pytest.mark.parametrize(
    "args,why",
    [
        (["--sync", "tokens"], "--shard runs under sync bsp"),
        (["--resume", "r"], "--shard: only with --job"),
        (["--nproc-per-node", "1"], "--shard: stages[0].shard: a stage of one worker has nothing to shard over"),
        (["--global-batch", "5", "--micro-batch", "2"], "--shard: stages[0].workers: the workers of a sharded stage"),
    ],
)
def test_shard_flags_that_cannot_run_exit_2_in_one_line(args, why, tmp_path):
    base = ["launch", "--shard", "--runs-root", str(tmp_path)]
    flags = {"--nproc-per-node": "2", "--global-batch": "8", **dict(zip(args[::2], args[1::2]))}
    job = ["--job", LLAMA, *(item for pair in flags.items() for item in pair)] if "--resume" not in args else args
    result = runner.invoke(app, [*base, *job])
    assert result.exit_code == 2 and why in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "felactl-job-" not in result.output  # no scratch plan


@pytest.mark.multiprocess
def test_launch_shard_trains_a_job_with_each_worker_holding_half(tmp_path):
    args = ["launch", "--job", LLAMA, "--nproc-per-node", "2", "--global-batch", "8", "--shard", "--steps", "3"]
    result = runner.invoke(app, [*args, "--runs-root", str(tmp_path), "--run-id", "s", "--json"])
    assert result.exit_code == 0, result.output
    run = tmp_path / "s"
    held = [json.loads((run / "workers" / f"rank{r}.json").read_text())["params_held"] for r in range(2)]
    whole = sum(p.numel() for p in models.build(LLAMA).model.parameters())
    assert sum(held) == whole and max(held) < whole
    exported = runner.invoke(app, ["export", "s", "--runs-root", str(tmp_path), "-o", str(tmp_path / "m.pt")])
    assert exported.exit_code == 0, exported.output
    models.build(LLAMA).model.load_state_dict(torch.load(tmp_path / "m.pt"), strict=True)


@pytest.mark.multiprocess
@pytest.mark.parametrize("shape", ["sharded", "pipeline"])
def test_a_resumed_run_ends_where_one_run_ends(tmp_path, shape):
    """3 steps, then 3 more from their checkpoint, equal 6 in one go: a sharded stage's 2 workers
    each write their shards (model and AdamW state, with torch.distributed.checkpoint), and 4
    workers read them back resharded (their sums in another order: within 1e-5); a 2-stage
    pipeline's stages (the tied head in both) load their own weights back, bit for bit."""
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    if shape == "sharded":
        plan, resumed_plan, tolerance = _sharded_plan(SMALL), _sharded_plan(SMALL, num_workers=4), 1e-5
    else:
        plan = dataclasses.replace(
            pipeline_plan([0, 2, 4], 1, "1f1b", micro_batch=3, global_batch=8, config=SMALL),
            model=ModelRef(name=LLAMA, source=LLAMA, config=SMALL),
        )
        resumed_plan, tolerance = plan, 1e-6
    for name in ("whole", "cut", "resumed"):
        (tmp_path / name).mkdir()
    whole = run_plan(plan, tmp_path / "whole", 6, env=env)
    cut = run_plan(plan, tmp_path / "cut", 3, env=env)
    resumed = run_plan(
        resumed_plan,
        tmp_path / "resumed",
        6,
        env={**env, "FELACTL_RESUME_FROM": str(checkpoint_path(cut, 3, 0).parent)},
    )
    assert _largest_difference(_trained(resumed_plan, resumed, 6), _trained(plan, whole, 6)) < tolerance


def test_a_tied_weight_counts_once_in_the_models_parameters():
    """The profile's layers each count the weight they read (a stage holding the head holds a
    copy); the model's total counts it once, as the model has it."""
    from felactl.profiling.model import profile_model

    spec = profile_model(LLAMA, SMALL, [2], repeats=1)
    (tied,) = spec.tied
    assert tied.layers == (0, 3) and tied.params == spec.layers[0].params
    assert spec.total_params == sum(p.numel() for p in models.build(LLAMA, SMALL).model.parameters())


@pytest.mark.multiprocess
def test_a_plan_its_model_does_not_fit_exits_2_though_only_the_workers_can_tell(tmp_path):
    """A plan whose stages cover more layers than the model has (its config changed by hand after
    planning): the workers find it as they build the model and refuse it (exit 2); the launch
    says so as bad input, exit 2, not as a failed run."""
    plan = dataclasses.replace(
        pipeline_plan([0, 2, 4], 1, "1f1b", micro_batch=3, global_batch=8, config=dict(SMALL, depth=3)),
        model=ModelRef(name=LLAMA, source=LLAMA, config=SMALL),  # planned for 3 blocks, 2 given
    )
    path = tmp_path / "plan.yaml"
    from felactl.spec import save

    save(
        dataclasses.replace(plan, stages=plan.stages[:-1] + (dataclasses.replace(plan.stages[-1], layer_end=5),)), path
    )
    result = runner.invoke(app, ["launch", str(path), "--steps", "2", "--runs-root", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    assert "the stages cover 5 layers but model" in result.output


def test_an_input_shape_for_a_model_that_brings_its_data_is_refused():
    result = runner.invoke(app, ["profile", "--model", LLAMA, "--input-shape", "3,32,32", "--batch-sizes", "2"])
    assert result.exit_code == 2 and "--input-shape is for a model that comes without data" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
