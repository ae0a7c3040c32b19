"""The CUDA/NCCL path of the worker runtime, where a GPU exists."""

from __future__ import annotations

import pytest
import torch
from _worker_helpers import dp_plan, final_params, placed, reference_params, run_plan

from felactl.control.metrics import write_summary
from felactl.spec import DeviceKind

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)")]


def test_bsp_on_one_gpu_matches_single_process(tmp_path):
    plan = placed(dp_plan(1, "bsp"), DeviceKind.CUDA)  # the worker runs NCCL because its plan says GPUs
    run_dir = run_plan(plan, tmp_path, 3)
    assert (final_params(run_dir, 3) - reference_params(plan, 3)).abs().max().item() < 1e-4
    assert write_summary(run_dir)["steps"] == 3
