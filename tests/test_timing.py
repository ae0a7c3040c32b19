"""Timings that say how far to trust them (felactl.profiling.timing), with made-up clocks and times."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from felactl.profiling.data_parallel import sync_settled, sync_timing
from felactl.profiling.timing import difference, relative_spread, repeat_until_stable
from felactl.spec import ModelSpec, SyncTiming, from_dict
from felactl.spec.codec import decode, encode

FIELDS = {"cluster": "here", "devices": ("a", "b"), "backend": "gloo", "micro_batch": 8}


def _blocks(values):
    it = iter(values)
    return lambda: next(it)


def test_relative_spread_is_the_iqr_over_the_median():
    assert relative_spread([10.0, 10.0, 10.0]) == 0.0
    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4 - 2) / 3)
    assert relative_spread([5.0]) == 0.0 and relative_spread([0.0, 0.0]) == math.inf


def test_stable_blocks_stop_at_the_minimum():
    timed = repeat_until_stable(_blocks([10.0, 10.2, 9.9, 50.0, 50.0]), max_blocks=8)
    assert timed.blocks == (10.0, 10.2, 9.9) and not timed.noisy
    assert timed.median == 10.0 and timed.spread < 0.05


def test_a_spike_costs_more_blocks_not_the_median():
    timed = repeat_until_stable(_blocks([40.0, 10.0, 10.1, 10.0, 9.9, 10.0]), max_blocks=8)
    assert not timed.noisy and len(timed.blocks) == 5 and timed.median == 10.0


def test_blocks_that_never_agree_are_noisy_with_their_spread_recorded():
    timed = repeat_until_stable(_blocks(itertools.cycle([10.0, 30.0])), max_blocks=6)
    assert len(timed.blocks) == 6 and timed.noisy
    assert timed.spread == pytest.approx(20.0 / 20.0)


def test_the_time_cap_stops_noisy_blocks_but_never_below_the_minimum():
    now = [0.0]
    values = itertools.cycle([10.0, 30.0])

    def block() -> float:  # each block takes one fake second
        now[0] += 1.0
        return next(values)

    timed = repeat_until_stable(block, max_blocks=100, max_s=4.0, clock=lambda: now[0])
    assert timed.noisy and len(timed.blocks) == 4
    fast_cap = repeat_until_stable(_blocks(itertools.cycle([10.0, 30.0])), max_blocks=100, max_s=0.0)
    assert fast_cap.noisy and len(fast_cap.blocks) == 3


def _pairs(with_ms, without_ms):
    return [([w / 1e3] * 5, [wo / 1e3] * 5) for w, wo in zip(with_ms, without_ms)]


def test_a_difference_above_its_noise_is_measured():
    diff = difference(_pairs([36, 37, 35, 36], [30, 31, 30, 30]))
    assert diff.estimate == pytest.approx(0.006) and diff.noise < 1e-3 and diff.settled()


def test_a_difference_hidden_in_noise_is_unknown_never_zero():
    # a busy machine: the local blocks happened to be preempted more than the synced ones
    noisy = _pairs([30, 52, 31, 49, 30, 55], [41, 30, 50, 31, 52, 30])
    diff = difference(noisy)
    assert diff.estimate is None and diff.noise > 0 and not diff.settled()
    timing = sync_timing(noisy, **FIELDS)
    assert timing.sync_ms is None and timing.noise_ms > 0 and timing.noisy and not timing.measured
    # a single pair has no noise estimate: not a measurement either
    assert difference(_pairs([36], [30])).estimate is None


def test_sync_is_never_stored_as_zero():
    # the old code stored max(0, median - median): 0.0 here, or for any with-sync step that rounds away
    assert sync_timing(_pairs([30, 30, 30, 30], [30, 30, 30, 30]), **FIELDS).sync_ms is None
    assert sync_timing(_pairs([30.0004] * 4, [30] * 4), **FIELDS).sync_ms is None  # 0.4 us rounds to 0.000 ms
    longer = sync_timing(_pairs([38, 36, 37, 36], [30, 30, 31, 30]), **FIELDS)
    assert longer.sync_ms == pytest.approx(6.0) and longer.measured and not longer.noisy


def test_pairs_are_added_until_the_noise_is_small_next_to_the_step():
    assert not sync_settled(_pairs([36, 46, 35], [30, 30, 31]))
    assert sync_settled(_pairs([36, 36.2, 35.9], [30, 30, 30.1]))


def test_a_sync_timing_without_sync_ms_round_trips_and_old_ones_still_load():
    unknown = SyncTiming(**FIELDS, noise_ms=4.2, noisy=True)
    assert decode(SyncTiming, encode(unknown), "test") == unknown and "sync_ms" not in encode(unknown)
    old = decode(
        SyncTiming,
        {"cluster": "c", "devices": ["a", "b"], "backend": "gloo", "micro_batch": 4, "sync_ms": 0.0},
        "old.yaml",
    )
    assert old.noise_ms is None and not old.noisy and not old.measured
    with pytest.raises(Exception, match="noise_ms: must be >= 0"):
        decode(SyncTiming, {**encode(unknown), "noise_ms": -1.0}, "test")


def test_a_model_profile_written_before_spreads_loads_and_says_what_to_distrust():
    from tests.planner_fixtures import model

    old = encode(model([(10, 10, 1.0)]))
    old.pop("noisy")
    for layer in old["layers"]:
        for timing in layer.get("timings", []):
            timing.pop("spread", None)
    spec = from_dict(ModelSpec, old, "old-model.yaml")
    assert spec.noisy == () and spec.untrusted() == []
    spec = dataclasses.replace(
        spec,
        noisy=("layers[0].timings[0]: spread 0.40",),
        data_parallel_sync=(
            SyncTiming(**FIELDS, sync_ms=0.0),
            SyncTiming(**{**FIELDS, "devices": ("b", "c")}, sync_ms=5.0, noise_ms=2.0, noisy=True),
        ),
    )
    assert spec.untrusted() == [
        "layers[0].timings[0]: spread 0.40",
        "data_parallel_sync[0]: sync not told apart from its noise",
        "data_parallel_sync[1]: sync 5 ms, noisy (noise 2 ms)",
    ]
