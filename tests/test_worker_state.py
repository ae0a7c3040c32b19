"""State replication to a newcomer by broadcast (Elan's IO-free way; used by live rescaling)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from felactl import models
from felactl.agents.worker.checkpoint import broadcast_state, load_checkpoint, save_checkpoint

CONFIG = {"input_dim": 16, "hidden": 32, "depth": 2}


def _peer(rank: int, init_file: str, out_path: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )
    try:
        bundle = models.build("mlp", CONFIG, seed=rank)  # different weights on purpose
        optimizer = torch.optim.AdamW(bundle.layers.parameters(), lr=1e-2)
        step, position = 0, 0
        if rank == 0:  # the live worker has trained; the newcomer has nothing
            for step in range(3):
                inputs, targets = bundle.data.batch(range(step * 8, step * 8 + 8))
                bundle.loss(bundle.layers(inputs), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
            step, position = 3, 24
        step, position = broadcast_state(bundle.layers, optimizer, step=step, data_position=position, src=0)
        inputs, targets = bundle.data.batch(range(24, 32))  # one more step each: must stay identical
        bundle.loss(bundle.layers(inputs), targets).backward()
        optimizer.step()
        torch.save(
            {
                "params": torch.nn.utils.parameters_to_vector(bundle.layers.parameters()).detach(),
                "step": step,
                "position": position,
            },
            out_path.format(rank=rank),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_newcomer_receives_params_optimizer_state_and_position(tmp_path):
    out = str(tmp_path / "rank{rank}.pt")
    mp.start_processes(_peer, args=(str(tmp_path / "init"), out), nprocs=2, join=True, start_method="spawn")
    a, b = (torch.load(out.format(rank=r)) for r in range(2))
    assert (a["step"], a["position"]) == (b["step"], b["position"]) == (3, 24)
    assert torch.equal(a["params"], b["params"]), "with the same AdamW moments, the next step matches exactly"


def test_checkpoint_round_trip(tmp_path):
    bundle = models.build("mlp", CONFIG, seed=0)
    optimizer = torch.optim.AdamW(bundle.layers.parameters(), lr=1e-2)
    inputs, targets = bundle.data.batch(range(8))
    bundle.loss(bundle.layers(inputs), targets).backward()
    optimizer.step()
    path = save_checkpoint(
        tmp_path / "c" / "stage0.pt", model=bundle.layers, optimizer=optimizer, step=1, data_position=8
    )
    assert [p.name for p in path.parent.iterdir()] == ["stage0.pt"], "no temp file left behind"
    fresh = models.build("mlp", CONFIG, seed=5)
    fresh_opt = torch.optim.AdamW(fresh.layers.parameters(), lr=1e-2)
    state = load_checkpoint(path, fresh.layers, fresh_opt)
    assert (state["step"], state["data_position"]) == (1, 8)
    for p, q in zip(bundle.layers.parameters(), fresh.layers.parameters()):
        assert torch.equal(p, q)
    assert fresh_opt.state_dict()["state"][0]["step"] == 1
