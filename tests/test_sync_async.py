"""WBSP and SDPipe on real worker processes: the loss falls, no sample is trained twice, and the
replicas are identical after the final pull / average."""

from __future__ import annotations

import json

import pytest

from _worker_helpers import dp_plan, metrics, run_plan

pytestmark = pytest.mark.multiprocess
STEPS = 30


def _checks(run_dir, num_workers: int) -> list[dict]:
    records = metrics(run_dir)
    assert sum(r["samples"] for r in records) == STEPS * 32, "every sample is trained exactly once"
    summaries = [json.loads((run_dir / "workers" / f"rank{r}.json").read_text()) for r in range(num_workers)]
    checksums = [s["param_checksum"] for s in summaries]
    assert max(checksums) - min(checksums) < 1e-6, f"replicas differ: {checksums}"
    records.sort(key=lambda r: r["time"])
    first = sum(r["loss"] for r in records[:6]) / 6
    last = sum(r["loss"] for r in records[-6:]) / 6
    assert last < first - 0.3, f"loss should fall: first {first:.3f}, last {last:.3f}"
    return records


@pytest.mark.parametrize("overlap", [False, True])
def test_wbsp_trains_and_replicas_end_equal(tmp_path, overlap):
    plan = dp_plan(2, "wbsp", optimizer="adamw", lr=1e-2, overlap=overlap,
                   config={"input_dim": 256, "hidden": 512, "depth": 2})  # compute well above the push/pull
    run_dir = run_plan(plan, tmp_path, STEPS, env={"FELACTL_SLOWDOWN": "1=3"})
    records = _checks(run_dir, 2)
    fast = sum(1 for r in records if r["rank"] == 0)
    slow = sum(1 for r in records if r["rank"] == 1)
    assert fast > slow, f"nobody waits in WBSP: the fast worker takes more local steps ({fast} vs {slow})"
    assert all(r["wait_s"] == 0 for r in records)


def test_sdpipe_trains_and_replicas_end_equal(tmp_path):
    plan = dp_plan(3, "sdpipe", optimizer="adamw", lr=1e-2, shares=[0.375, 0.3125, 0.3125], connect_every=2)
    run_dir = run_plan(plan, tmp_path, STEPS)
    _checks(run_dir, 3)
    sizes = json.loads((run_dir / "workers" / "rank0.json").read_text())["sdpipe_group_sizes"]["stage0"]
    assert sum(int(n) * count for n, count in sizes.items() if int(n) >= 2) > 0, f"groups formed: {sizes}"
