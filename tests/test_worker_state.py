"""A worker's checkpoint: parameters, optimizer state, step and data position round-trip."""

from __future__ import annotations

import torch

from felactl import models
from felactl.agents.worker.checkpoint import load_checkpoint, save_checkpoint, stage_state

CONFIG = {"input_dim": 16, "hidden": 32, "depth": 2}


def test_checkpoint_round_trip(tmp_path):
    bundle = models.build("mlp", CONFIG, seed=0)
    optimizer = torch.optim.AdamW(bundle.layers.parameters(), lr=1e-2)
    inputs, targets = bundle.data.batch(range(8))
    bundle.loss(bundle.layers(inputs), targets).backward()
    optimizer.step()
    path = save_checkpoint(
        tmp_path / "c" / "stage0.pt", state=stage_state(bundle.layers, optimizer), step=1, data_position=8
    )
    assert [p.name for p in path.parent.iterdir()] == ["stage0.pt"], "no temp file left behind"
    fresh = models.build("mlp", CONFIG, seed=5)
    fresh_opt = torch.optim.AdamW(fresh.layers.parameters(), lr=1e-2)
    state = load_checkpoint(path, fresh.layers, fresh_opt)
    assert (state["step"], state["data_position"]) == (1, 8)
    for p, q in zip(bundle.layers.parameters(), fresh.layers.parameters()):
        assert torch.equal(p, q)
    assert fresh_opt.state_dict()["state"][0]["step"] == 1
