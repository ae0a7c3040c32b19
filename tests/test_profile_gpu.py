"""The CUDA path of ``felactl profile``: GPU slots, fp32/bf16 TFLOP/s, NCCL send/recv, NVLink/PCIe types.

Runs where CUDA exists; skipped with the reason elsewhere.
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from felactl.cli.main import app

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
runner = CliRunner()


def test_profile_gpus(tmp_path):
    num_gpus = torch.cuda.device_count()
    result = runner.invoke(
        app,
        [
            "profile",
            "--device",
            "cuda",
            "--node-name",
            "box",
            "--gpu-matmul-size",
            "2048",
            "--message-bytes",
            str(4 * 2**20),
            "--repetitions",
            "3",
            "-o",
            str(tmp_path / "c.yaml"),
            "--json",
            "--timeout",
            "120",
        ],
    )
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    devices = [d for n in data["nodes"] for d in n["devices"]]
    assert [d["name"] for d in devices] == [f"box-gpu{i}" for i in range(num_gpus)]
    assert all(d["kind"] == "cuda" and d["tflops"] > 0.1 and d["memory_gb"] > 1 for d in devices)
    assert all(d["bf16_tflops"] > 0 for d in devices if torch.cuda.is_bf16_supported())
    assert len(data["links"]) == num_gpus * (num_gpus - 1)
    assert all(
        l["type"] in ("nvlink", "pcie") and l["bandwidth_gbps"] > 0 and l["latency_us"] > 0 for l in data["links"]
    )
    if num_gpus > 1:
        assert len(data["peer_copy_gbps"]) == num_gpus * (num_gpus - 1)
