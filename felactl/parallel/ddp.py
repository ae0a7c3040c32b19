"""``DistributedDataParallel`` as felactl wraps a replica: one place, for the runtime and for the
profiler that times a data-parallel step as the runtime runs it (felactl.profiling.data_parallel)."""

from __future__ import annotations

import inspect

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from felactl.spec.plan import BUCKET_BYTES

_DDP_PARAMETERS = inspect.signature(DistributedDataParallel.__init__).parameters


def wrap_replica(module: nn.Module, group=None, *, device_ids=None, init_sync: bool = True) -> DistributedDataParallel:
    """DDP without buffer sync in forward (after each step the loop gives every replica its
    stage's first replica's buffers, in every mode: :meth:`Trainer.sync_replicas`) and with
    gradients as views of DDP's buckets (no copy in or out). ``init_sync=False``: the replicas already hold the same
    parameters (a re-formed group), skip the broadcast. torch 2.13 renamed ``broadcast_buffers``
    to ``forward_sync_buffers``; older releases (2.11 on the GPU machines) know only the first.
    The later buckets' cap is passed, not left to torch's default: the planner prices the overlap
    of sync with backward by felactl's bucket rule (``felactl.spec.plan.gradient_buckets``), and
    the tokens runtime sums in the same buckets."""
    no_forward_sync = (
        {"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_PARAMETERS else {"broadcast_buffers": False}
    )
    return DistributedDataParallel(
        module,
        device_ids=device_ids,
        process_group=group,
        gradient_as_bucket_view=True,
        bucket_cap_mb=BUCKET_BYTES / 2**20,
        init_sync=init_sync,
        **no_forward_sync,
    )
