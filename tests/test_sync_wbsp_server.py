"""The WBSP parameter server's round logic, driven directly (no processes, no thread started)."""

from __future__ import annotations

import torch

from felactl.agents.worker.sync.wbsp import ParameterServer


def test_deltas_are_averaged_in_at_once_and_rounds_close_when_all_pushed():
    server = ParameterServer(torch.zeros(3), world_size=2, group=None)
    current, theta = server.apply(0, torch.tensor([2.0, 0.0, 0.0]))
    assert current == 0 and theta.tolist() == [1.0, 0.0, 0.0], "theta_g += delta / N immediately"
    current, _ = server.apply(0, torch.tensor([2.0, 0.0, 0.0]))
    assert current == 0, "a fast worker pushing twice does not close the round"
    current, theta = server.apply(1, torch.tensor([0.0, 4.0, 0.0]))
    assert current == 1 and theta.tolist() == [2.0, 2.0, 0.0], "the slowest worker's push closes it"


def test_a_leaving_worker_no_longer_holds_rounds_open():
    server = ParameterServer(torch.zeros(1), world_size=3, group=None)
    server.apply(0, torch.ones(1))
    server.apply(1, torch.ones(1))
    assert server.round == 0
    server.leave(2)
    assert server.round == 1
    assert server.apply(0, torch.ones(1))[0] == 1 and server.apply(1, torch.ones(1))[0] == 2
