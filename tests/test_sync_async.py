"""WBSP and SDPipe on real worker processes: the loss falls, no sample is trained twice, and the
replicas are identical after the final pull / average."""

from __future__ import annotations

import json

import pytest
import torch
from _worker_helpers import dp_plan, final_params, metrics, reference_params, run_plan

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
    plan = dp_plan(
        2, "wbsp", optimizer="adamw", lr=1e-2, overlap=overlap, config={"input_dim": 256, "hidden": 512, "depth": 2}
    )  # compute well above the push/pull
    run_dir = run_plan(plan, tmp_path, STEPS, env={"FELACTL_SLOWDOWN": "1=3"})
    records = _checks(run_dir, 2)
    # Nobody waits in WBSP: each worker steps at its own pace, busy the whole run. (It asserted that
    # the worker slowed 3x took fewer steps, which a loaded machine reversed once: 21 vs 39, rank
    # 0, which also hosts the store, starved by another test's processes on the two cores.)
    assert all(r["wait_s"] == 0 for r in records)
    busy = [sum(r["duration_s"] for r in records if r["rank"] == rank) for rank in (0, 1)]
    assert 0.5 < busy[0] / busy[1] < 2.0, f"both step for the whole run: busy {busy}"


def test_wbsp_with_one_worker_is_plain_sgd(tmp_path):
    """N = 1: every push closes a round and pulls theta_g += delta back, so WBSP must equal
    single-process SGD on the same batches. Catches a delta measured against a base that moved with
    the model after a pull (``set_flat_params`` makes the parameters views of the pulled tensor):
    then every delta was zero and theta_g never left its initial value."""
    plan = dp_plan(1, "wbsp")
    run_dir = run_plan(plan, tmp_path, STEPS)
    expected = reference_params(plan, STEPS)
    initial = reference_params(plan, 0)
    assert (expected - initial).norm() > 0.1, "the reference must move, or this test proves nothing"
    torch.testing.assert_close(final_params(run_dir, STEPS), expected, atol=1e-5, rtol=0)
    checksum = json.loads((run_dir / "workers" / "rank0.json").read_text())["param_checksum"]
    assert abs(checksum - float(expected.double().sum())) < 1e-3, (
        f"theta_g after the final pull: {checksum} vs SGD {float(expected.double().sum())}"
    )


def test_sdpipe_trains_and_replicas_end_equal(tmp_path):
    plan = dp_plan(3, "sdpipe", optimizer="adamw", lr=1e-2, shares=[0.375, 0.3125, 0.3125], connect_every=2)
    run_dir = run_plan(plan, tmp_path, STEPS)
    _checks(run_dir, 3)
    sizes = json.loads((run_dir / "workers" / "rank0.json").read_text())["sdpipe_group_sizes"]["stage0"]
    assert sum(int(n) * count for n, count in sizes.items() if int(n) >= 2) > 0, f"groups formed: {sizes}"
