"""A worker's checkpoint: parameters, optimizer state, step and data position round-trip, into
the same stage or into a plan that cuts the model elsewhere (a restart on other workers)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from felactl import models
from felactl.agents.worker.checkpoint import parameter_aliases, restore_stage, save_checkpoint, stage_state
from felactl.errors import InputError

CONFIG = {"input_dim": 16, "hidden": 32, "depth": 2}
LLAMA = {"seq_len": 16, "width": 32, "depth": 2, "num_heads": 2, "total_steps": 20}
"""examples/llama.py small: embedding, two blocks, a head tied to the embedding."""


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))


def test_checkpoint_round_trip(tmp_path):
    bundle = models.build("mlp", CONFIG, seed=0)
    optimizer = torch.optim.AdamW(bundle.layers.parameters(), lr=1e-2)
    inputs, targets = bundle.data.batch(range(8))
    bundle.loss(bundle.layers(inputs), targets).backward()
    optimizer.step()
    layers = (0, len(bundle.layers))
    path = save_checkpoint(
        tmp_path / "c" / "stage0.pt",
        state=stage_state(bundle.layers, optimizer),
        step=1,
        data_position=8,
        layers=layers,
    )
    assert [p.name for p in path.parent.iterdir()] == ["stage0.pt"], "no temp file left behind"
    fresh = models.build("mlp", CONFIG, seed=5)
    fresh_opt = torch.optim.AdamW(fresh.layers.parameters(), lr=1e-2)
    state = restore_stage(path.parent, 0, layers, fresh.layers, fresh_opt, {})
    assert (state["step"], state["data_position"]) == (1, 8)
    for p, q in zip(bundle.layers.parameters(), fresh.layers.parameters()):
        assert torch.equal(p, q)
    assert fresh_opt.state_dict()["state"][0]["step"] == 1


def _train(parts: list[tuple[torch.nn.Module, torch.optim.Optimizer]], bundle, steps: range) -> list[float]:
    """Steps of the chain of ``parts`` (one process: the stages' forward in turn, each its own
    optimizer; a tied weight two parts share is one tensor here, stepped by the first)."""
    losses = []
    for step in steps:
        inputs, targets = bundle.data.batch(range(step * 4, step * 4 + 4))
        for _, optimizer in parts:
            optimizer.zero_grad()
        out = inputs
        for module, _ in parts:
            out = module(out)
        loss = bundle.loss(out, targets)
        loss.backward()
        for _, optimizer in parts:
            optimizer.step()
        losses.append(loss.item())
    return losses


def _stages(bundle, cuts: list[int]) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    parts, owned = [], set()
    for a, b in zip(cuts, cuts[1:]):
        module = bundle.stage_module(a, b, whole=len(cuts) == 2)
        params = [p for p in module.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        parts.append((module, torch.optim.AdamW(params, lr=1e-2)))
    return parts


@pytest.mark.parametrize(
    "source, config", [("mlp", CONFIG), ("examples.llama:job", LLAMA)], ids=["sequential", "llama-tied"]
)
@pytest.mark.parametrize("new_cuts", [[0, None], [0, 1, 2, None]], ids=["one-stage", "three-stages"])
def test_a_checkpoint_of_two_stages_restores_into_another_cut_and_trains_on_the_same(
    source, config, new_cuts, tmp_path
):
    """Stages checkpointed by the names of the user's model (weights and the optimizer's state)
    restore into stages cut elsewhere, a tied head included, and the run goes on exactly: the
    losses and weights of training on equal those of never having stopped."""
    bundle = models.build(source, config, seed=0)
    num_layers = len(bundle.layer_names)
    old_cuts = [0, num_layers // 2 + 1, num_layers]
    old = _stages(bundle, old_cuts)
    _train(old, bundle, range(3))
    directory = tmp_path / "step000003"
    for s, (module, optimizer) in enumerate(old):
        save_checkpoint(
            directory / f"stage{s}.pt",
            state=stage_state(module, optimizer),
            step=3,
            data_position=12,
            layers=(old_cuts[s], old_cuts[s + 1]),
        )
    expected = _train(old, bundle, range(3, 6))
    fresh = models.build(source, config, seed=7)
    cuts = [c if c is not None else num_layers for c in new_cuts]
    new = _stages(fresh, cuts)
    aliases = parameter_aliases(fresh.model)
    for s, (module, optimizer) in enumerate(new):
        restore_stage(directory, s, (cuts[s], cuts[s + 1]), module, optimizer, aliases)
    assert _train(new, fresh, range(3, 6)) == pytest.approx(expected, rel=1e-6, abs=1e-7)
    trained = {k: v for module, _ in old for k, v in module.state_dict().items()}
    for module, _ in new:
        for key, value in module.state_dict().items():
            torch.testing.assert_close(value, trained[key], rtol=1e-6, atol=1e-7)


def test_a_checkpoint_written_before_names_still_restores_into_its_own_stage(tmp_path):
    """Checkpoints of earlier versions keyed the optimizer's state by index and said no layers:
    they restore into the stage that wrote them, as before."""
    bundle = models.build("mlp", CONFIG, seed=0)
    optimizer = torch.optim.AdamW(bundle.layers.parameters(), lr=1e-2)
    _train([(bundle.layers, optimizer)], bundle, range(2))
    legacy = {"model": bundle.layers.state_dict(), "optimizer": optimizer.state_dict(), "step": 2, "data_position": 8}
    torch.save(legacy, tmp_path / "stage0.pt")
    fresh = models.build("mlp", CONFIG, seed=5)
    fresh_optimizer = torch.optim.AdamW(fresh.layers.parameters(), lr=1e-2)
    restore_stage(tmp_path, 0, (0, len(fresh.layers)), fresh.layers, fresh_optimizer, {})
    assert _train([(fresh.layers, fresh_optimizer)], fresh, range(2, 4)) == _train(
        [(bundle.layers, optimizer)], bundle, range(2, 4)
    )


def test_a_checkpoint_that_lacks_a_weight_of_the_new_stage_is_refused_naming_it(tmp_path):
    bundle = models.build("mlp", CONFIG, seed=0)
    first = bundle.stage_module(0, 1)
    save_checkpoint(
        tmp_path / "stage0.pt",
        state=stage_state(first, torch.optim.SGD(first.parameters())),
        step=1,
        data_position=4,
        layers=(0, 1),
    )
    whole = copy.deepcopy(bundle.layers)
    with pytest.raises(InputError, match="no stage of the checkpoint holds"):
        restore_stage(tmp_path, 0, (0, len(whole)), whole, torch.optim.SGD(whole.parameters()), {})
