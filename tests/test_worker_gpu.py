"""The CUDA/NCCL path of the worker runtime, where a GPU exists."""

from __future__ import annotations

import pytest
import torch
from _worker_helpers import dp_plan, final_params, pipeline_plan, placed, reference_params, run_plan

from felactl.control.metrics import write_summary
from felactl.spec import DeviceKind

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")]
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL runs one rank per GPU, and a pipeline has two"
)


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
