"""One model profile from the profiles of each testbed node (felactl.profiling.merge)."""

from __future__ import annotations

import dataclasses

import pytest

from felactl.errors import ProfilingError
from felactl.profiling.merge import merge_device_profiles
from felactl.spec import LayerTiming, from_dict, to_dict
from tests.planner_fixtures import model


def _timed(device_model: str, ms: float, step_ms: float, tflops: float, noisy=()):
    base = model([(1000, 10, 1.0), (3000, 10, 1.0)])
    layers = tuple(
        dataclasses.replace(
            layer,
            timings=tuple(
                LayerTiming(device_model=device_model, micro_batch=b, fwd_ms=ms * b, bwd_ms=2 * ms * b, spread=0.01 * b)
                for b in (4, 16)
            ),
        )
        for layer in base.layers
    )
    return dataclasses.replace(
        base, layers=layers, optimizer_step_ms=step_ms, timed_tflops={device_model: tflops}, noisy=tuple(noisy)
    )


def test_each_nodes_timings_under_its_device_model_and_alike_nodes_as_their_median():
    merged = merge_device_profiles(
        {
            "big": _timed("X @ 0.6 cores", 1.0, 10.0, 0.09),
            "mid": _timed("X @ 0.3 cores", 2.0, 20.0, 0.045),
            "mid2": _timed("X @ 0.3 cores", 3.0, 40.0, 0.035, noisy=["layers[0].timings[1]: spread 0.3"]),
        }
    )
    assert merged.timed_device_models == {"X @ 0.6 cores", "X @ 0.3 cores"}
    assert merged.timed_tflops == {"X @ 0.6 cores": 0.09, "X @ 0.3 cores": 0.04}
    assert merged.optimizer_step_ms is None
    assert merged.optimizer_step_ms_of("X @ 0.6 cores") == 10.0 and merged.optimizer_step_ms_of("X @ 0.3 cores") == 30.0
    mid16 = next(t for t in merged.layers[1].timings if t.device_model == "X @ 0.3 cores" and t.micro_batch == 16)
    assert (mid16.fwd_ms, mid16.bwd_ms, mid16.spread) == (pytest.approx(40.0), pytest.approx(80.0), 0.16)
    assert merged.noisy == ("mid2: layers[0].timings[1]: spread 0.3",)
    assert from_dict(type(merged), to_dict(merged)) == merged, "the merged profile is a valid file"


def test_profiles_of_different_models_are_refused():
    a = _timed("X @ 0.6 cores", 1.0, 10.0, 0.09)
    wider = dataclasses.replace(a, layers=(dataclasses.replace(a.layers[0], params=2000), *a.layers[1:]))
    with pytest.raises(ProfilingError, match=r"a and b are of different models: layers\[0\] differ"):
        merge_device_profiles({"a": a, "b": wider})
    with pytest.raises(ProfilingError, match="config differ"):
        merge_device_profiles({"a": a, "b": dataclasses.replace(a, config={"hidden": 1})})
