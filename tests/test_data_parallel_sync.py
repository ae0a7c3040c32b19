"""The measured gradient sync of a data-parallel step (felactl.profiling.data_parallel): real
processes, one per slot, DDP over gloo."""

import psutil
import pytest

from felactl.errors import ProfilingError
from felactl.profiling.data_parallel import Slot, measure_data_parallel_sync
from felactl.spec import SyncTiming
from felactl.spec.codec import decode, encode

pytestmark = pytest.mark.multiprocess

SLOTS = [Slot("vm-cpu0", (0,)), Slot("vm-cpu1", (1,))]
QUICK = {"blocks": 2, "per_block": 6, "warmup": 1}


def _no_children_left() -> bool:
    """No slot process left (multiprocessing's own resource tracker may stay: it is shared)."""
    return not [p for p in psutil.Process().children(recursive=True)
                if "resource_tracker" not in " ".join(p.cmdline())]


def test_sync_grows_with_the_gradients_and_no_process_is_left():
    big = measure_data_parallel_sync("mlp", {"hidden": 1024, "depth": 4}, 16, SLOTS, **QUICK)  # 13 MB
    small = measure_data_parallel_sync("mlp", {"hidden": 8, "depth": 1}, 16, SLOTS, **QUICK)  # 8 KB
    assert big.devices == ("vm-cpu0", "vm-cpu1") and big.backend == "gloo" and big.micro_batch == 16
    assert big.sync_ms > 1.0, big  # gloo moves 13 MB in no less than a few ms here
    assert big.sync_ms > small.sync_ms + 1.0, (big, small)
    assert _no_children_left()


def test_a_slot_that_fails_is_named_and_the_others_are_stopped():
    with pytest.raises(ProfilingError, match="slot [01] failed: .*no-such-model"):
        measure_data_parallel_sync("no-such-model", {}, 4, SLOTS, **QUICK)
    assert _no_children_left()


def test_a_sync_timing_round_trips_and_needs_a_group():
    timing = SyncTiming(devices=("a", "b"), backend="gloo", micro_batch=16, sync_ms=6.2)
    assert decode(SyncTiming, encode(timing), "test") == timing
    with pytest.raises(Exception, match="two or more distinct devices"):
        SyncTiming(devices=("a",), backend="gloo", micro_batch=16, sync_ms=1.0)
