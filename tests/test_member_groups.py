"""Groups of a subset of the ranks formed mid-run by their members alone
(:meth:`Runtime.members_group`), as the tokens mode forms them for an iteration a stalled worker
skipped: real gloo processes whose histories differ (rank 0 has formed a group before, rank 1
has not), the case ``new_group(use_local_synchronization=True)`` hangs on."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from pathlib import Path

import pytest
import torch

from felactl.agents.worker import runtime as runtime_mod
from felactl.agents.worker.config import WorkerConfig
from felactl.profiling.data_parallel import reap

pytestmark = pytest.mark.multiprocess


def _member(rank: int, port: int, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    cfg = WorkerConfig(
        rank=rank,
        local_rank=rank,
        world_size=3,
        store_host="127.0.0.1",
        store_port=port,
        host_store=rank == 0,
        plan_path=Path("unused"),
        run_dir=Path("unused"),
        timeout_s=20.0,
    )
    runtime = runtime_mod.start(cfg, "gloo")
    try:
        for ranks in ((0, 2), (0, 1), (0, 2)):  # {0, 2} again: the cached group
            if rank in ranks:
                flat = torch.full((5,), float(rank + 1))
                runtime_mod.all_reduce_async(flat, runtime.members_group(ranks)).wait()
                results.put((rank, ranks, flat.tolist()))
    finally:
        runtime.close()


def test_members_form_groups_of_a_subset_whatever_groups_each_formed_before():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, port, results)) for r in range(3)]
    try:
        for p in procs:
            p.start()
        got = sorted(results.get(timeout=30) for _ in range(6))
    finally:
        reap(procs, grace_s=10.0)
    want = {(0, 2): 4.0, (0, 1): 3.0}
    assert len(got) == 6 and all(values == [want[ranks]] * 5 for _, ranks, values in got), got
