"""The CUDA/NCCL path of the worker runtime, where a GPU exists."""

from __future__ import annotations

import pytest
import torch
from _worker_helpers import dp_plan, final_params, pipeline_plan, placed, reference_params, run_plan, single_process

from felactl.control.metrics import write_summary
from felactl.spec import DeviceKind

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")]
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL runs one rank per GPU, and a pipeline has two"
)


def test_a_model_whose_build_asks_for_cuda_is_built_once_by_the_zygote_and_trains_on_the_gpu(tmp_path):
    """torch.cuda.is_available() inits the CUDA driver (is_initialized() stays False), and a fork
    of a process that did cannot use CUDA: the zygote asks NVML instead
    (PYTORCH_NVML_BASED_CUDA_CHECK), so its fork trains on the GPU with the model it built."""
    import dataclasses
    import os
    from pathlib import Path

    from felactl.spec import ModelRef

    tests = Path(__file__).parent
    record = tmp_path / "builds"
    model = ModelRef(
        name="counted", source="_user_models:counted_builds", config={"record": str(record), "leave": "cuda_check"}
    )
    plan = placed(dataclasses.replace(dp_plan(1, "bsp"), model=model), DeviceKind.CUDA)
    run_dir = run_plan(plan, tmp_path, 3, env={"PYTHONPATH": f"{tests}:{os.environ.get('PYTHONPATH', '')}"})
    assert len(record.read_text().split()) == 1  # the zygote's build, taken by the worker it forked
    assert (final_params(run_dir, 3) - reference_params(plan, 3)).abs().max().item() < 1e-4


def test_bsp_on_one_gpu_matches_single_process(tmp_path):
    plan = placed(dp_plan(1, "bsp"), DeviceKind.CUDA)  # the worker runs NCCL because its plan says GPUs
    run_dir = run_plan(plan, tmp_path, 3)
    assert (final_params(run_dir, 3) - reference_params(plan, 3)).abs().max().item() < 1e-4
    assert write_summary(run_dir)["steps"] == 3


@two_gpus
def test_a_two_stage_pipeline_on_two_gpus_matches_single_process(tmp_path):
    """Written without a GPU to run it on (none of this project's lent machines had two): the
    static pipeline's point-to-point messages and each stage's optimizer over NCCL."""
    plan = placed(pipeline_plan([0, 2, 3], optimizer="adamw", lr=0.01), DeviceKind.CUDA)
    run_dir = run_plan(plan, tmp_path, 3)
    trained = torch.cat([final_params(run_dir, 3, stage) for stage in range(2)])
    assert (trained - reference_params(plan, 3)).abs().max().item() < 1e-4


@two_gpus
@pytest.mark.parametrize("shape", ["pipeline", "sharded"])
def test_the_split_lm_trains_on_two_gpus_in_bf16_near_its_fp32_losses(tmp_path, shape):
    """Written without a GPU to run it on (none of this project's lent machines had two): the
    LLaMA-shaped example cut at a block into 2 stages (point-to-point over NCCL), or sharded over
    both GPUs (FSDP2), forward and loss under bf16 autocast; each step's loss within bf16's
    precision of single-process fp32 training on the CPU."""
    import dataclasses
    import os
    from pathlib import Path

    from test_split_models import LLAMA, SMALL, _sharded_plan, _step_losses

    from felactl.spec import ModelRef

    tests = Path(__file__).parent
    bf16 = dict(SMALL, precision="bf16")
    if shape == "pipeline":
        plan = pipeline_plan([0, 2, 4], 1, "1f1b", micro_batch=2, global_batch=8, config=bf16)
        plan = dataclasses.replace(plan, model=ModelRef(name=LLAMA, source=LLAMA, config=bf16))
    else:
        plan = _sharded_plan(bf16)
    env = {"PYTHONPATH": f"{tests.parent}:{tests}:{os.environ.get('PYTHONPATH', '')}"}
    run_dir = run_plan(placed(plan, DeviceKind.CUDA), tmp_path, 5, env=env)
    _, fp32_losses = single_process(plan, 5)
    assert _step_losses(run_dir) == pytest.approx(fp32_losses, abs=5e-2)
