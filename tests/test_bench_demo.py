"""benchmarks/bench_demo.py's measurement: the slowest worker's step, median after warm-up."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_demo", Path(__file__).parents[1] / "benchmarks" / "bench_demo.py")
bench_demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_demo)


def _record(rank, step, duration_s, end):
    return {
        "rank": rank,
        "step": step,
        "duration_s": duration_s,
        "time": end,
        "compute_s": duration_s * 0.9,
        "wait_s": 0.0,
        "comm_s": duration_s * 0.1,
    }


def test_iteration_time_is_the_slowest_workers_step_after_warmup():
    records = [_record(0, 0, 5.0, 5.0), _record(1, 0, 4.0, 5.0)]  # warm-up: excluded
    for step in range(1, 6):
        records += [_record(0, step, 0.10, 5 + 0.2 * step), _record(1, step, 0.20 + 0.01 * step, 5 + 0.2 * step)]
    got = bench_demo.iteration_times(records, warmup=1)
    assert got["steps"] == 5
    assert got["iteration_s"] == pytest.approx(0.23)
    assert got["cadence_s"] == pytest.approx(0.2)


def test_no_steps_after_warmup_is_an_error():
    with pytest.raises(SystemExit):
        bench_demo.iteration_times([_record(0, 0, 1.0, 1.0)], warmup=5)
