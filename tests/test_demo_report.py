"""What ``felactl demo`` says of its result, with the pipeline faked (no processes)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from felactl.cli.main import app
from felactl.spec import SyncTiming
from tests.planner_fixtures import model

SUMMARY = {"steps": 4, "first_loss": 2.0, "final_loss": 1.0, "samples_per_s": 600.0, "run_dir": "runs/d", "run": "d"}


def _fake_quickstart(spec):
    def quickstart(options, say, show=None, on_update=None):
        return {
            "cluster": "c.yaml",
            "model": "m.yaml",
            "plan": "p.yaml",
            "model_spec": spec,
            "summary": SUMMARY,
            "plan_spec": SimpleNamespace(predicted=SimpleNamespace(iteration_s=0.05, samples_per_s=640.0)),
        }

    return quickstart


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "human"])
def test_demo_says_when_the_profile_was_too_noisy_to_trust(monkeypatch, as_json):
    noisy = dataclasses.replace(
        model([(10, 10, 1.0)]),
        noisy=("layers[0].timings[0]: spread 0.40",),
        data_parallel_sync=(
            SyncTiming(cluster="c", devices=("a", "b"), backend="gloo", micro_batch=8, noise_ms=6.0, noisy=True),
        ),
    )
    monkeypatch.setattr("felactl.quickstart.quickstart", _fake_quickstart(noisy))
    result = CliRunner().invoke(app, ["demo", "--steps", "4"] + (["--json"] if as_json else []))
    assert result.exit_code == 0, result.output
    if as_json:
        assert json.loads(result.stdout)["profile_untrusted"] == [
            "layers[0].timings[0]: spread 0.40",
            "data_parallel_sync[0]: sync not told apart from its noise (noise 6 ms)",
        ]
    else:
        assert "the profile was too noisy to trust (2 timing(s) did not settle" in " ".join(result.output.split())


def test_demo_says_nothing_of_noise_for_a_profile_that_settled(monkeypatch):
    monkeypatch.setattr("felactl.quickstart.quickstart", _fake_quickstart(model([(10, 10, 1.0)])))
    result = CliRunner().invoke(app, ["demo", "--steps", "4", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["profile_untrusted"] == [] and "too noisy" not in result.output
