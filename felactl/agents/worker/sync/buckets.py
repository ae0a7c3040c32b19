"""Gradients in a few flat buffers, summed by allreduce as soon as each buffer is complete.

``p.grad`` of every parameter is a view into one of the buffers (like DDP's
``gradient_as_bucket_view``), so accumulating micro-batches writes straight into what the
allreduce sends: no concatenation before, no copy back after. Buckets follow the reverse
parameter order, the order backward produces gradients in, and close as DDP's do
(:func:`felactl.spec.plan.gradient_buckets`: a small first one, then 25 MiB), so the planner prices
one rule for bsp and tokens.

Once :meth:`arm` is called (the worker knows the micro-batch it starts is its last of the
iteration), a hook launches each bucket's asynchronous sum-allreduce the moment backward has
accumulated every gradient of that bucket, so communication overlaps the rest of the backward
(and, for an injected straggler, its sleep). A worker that cannot tell yet (tokens: another
worker may still leave it one) calls :meth:`arm_if_last` instead: the question is asked again when
backward completes a bucket, and a yes arms the buckets there. Without it the first of two
workers with a token each summed only after its backward, and the other's sum waited for it: none
of the overlap the planner prices happened (issue 15, the fragment testbed's 75 ms sum).
:meth:`finish` launches whatever was not launched yet, always in bucket order, so every member of the group issues the same collectives in the same
order whether it armed or not. The group is given per iteration (to :meth:`arm` and
:meth:`finish`), since it may change (a tokens iteration that a stalled worker skipped is summed
by the others alone); ``None`` means this worker's gradients are already the sum: nothing is sent.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

import torch

from felactl.agents.worker.runtime import all_reduce_async
from felactl.spec.plan import gradient_buckets


class _TreeThread:
    """The buckets' one thread for sums over the plan's trees: the trees' walks match messages by
    sender and tag alone, so two buckets must not stream at once, and every rank sums them in
    bucket order. A daemon, unlike an executor's: a sum stuck on a dead peer must not hold up the
    worker's exit."""

    def __init__(self, trees):
        self.trees, self.queue = trees, queue.SimpleQueue()
        threading.Thread(target=self._run, name="felactl-tree-buckets", daemon=True).start()

    def submit(self, buffer: torch.Tensor) -> torch.futures.Future:
        """Sum ``buffer`` along the trees after the buckets submitted before; ``wait()`` on the
        returned future raises what the sum raised."""
        future: torch.futures.Future = torch.futures.Future()
        self.queue.put((buffer, future))
        return future

    def _run(self) -> None:
        while True:
            buffer, future = self.queue.get()
            try:
                self.trees(buffer)
                future.set_result(None)
            except BaseException as exc:  # handed to the waiting training thread
                future.set_exception(exc)


class GradBuckets:
    def __init__(self, params: Sequence[torch.Tensor], *, trees=None, trees_group=None):
        """``trees``: the plan's :class:`~felactl.agents.worker.sync.trees.TreeAllreduce` over
        ``trees_group``; a sum over that group goes along them, over any other group (some of the
        workers) through the backend's allreduce."""
        self.trees, self.trees_group = trees, trees_group
        self._tree_thread = _TreeThread(trees) if trees is not None else None
        self.group = None
        self.params = [p for p in params if p.requires_grad]
        backward_order = list(reversed(self.params))
        assignment = gradient_buckets([p.numel() * p.element_size() for p in backward_order])
        self.buckets: list[list[torch.Tensor]] = [[] for _ in range(max(assignment, default=-1) + 1)]
        for p, index in zip(backward_order, assignment, strict=True):
            self.buckets[index].append(p)
        self.buffers = [
            torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device) for b in self.buckets
        ]
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.views: dict[int, torch.Tensor] = {}
        for bucket, buffer in zip(self.buckets, self.buffers):
            offset = 0
            for p in bucket:
                self.views[id(p)] = buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self.armed = False
        self.pending: list[int] = []
        self.works: list = []
        self._ask: tuple | None = None
        self.launched_in_backward = 0
        """Buckets of the last iteration whose sum began inside backward (the step's metrics)."""
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._accumulated)

    def begin(self) -> None:
        """Zero the buffers and point every ``p.grad`` at its view (the optimizer's
        ``zero_grad(set_to_none=True)`` dropped them)."""
        for buffer in self.buffers:
            buffer.zero_()
        for p in self.params:
            p.grad = self.views[id(p)]
        self.armed = False
        self._ask = None
        self.works = []
        self.launched_in_backward = 0

    def arm(self, group) -> None:
        """From the backward about to run on, sum each bucket over ``group`` as soon as it is complete."""
        self._count_from_now()
        self._armed_over(group)

    def _armed_over(self, group) -> None:
        self.group, self.armed, self._ask = group, True, None

    def arm_if_last(self, is_last, group_of) -> None:
        """The backward about to run may be this iteration's last: when it completes a bucket (the
        first to complete; the first one, unless backward never reaches one of its parameters),
        :meth:`arm` over ``group_of()`` if ``is_last()`` says so (asked once). The caller reads
        :attr:`armed` after the backward: armed, it must run no more micro-batches. Both run
        inside backward and may wait on the store (closing the iteration's gate, forming a group
        of some workers the first time), which only delays what they would delay after it."""
        self._count_from_now()
        self._ask = (is_last, group_of)

    def _count_from_now(self) -> None:
        self.pending = [len(b) for b in self.buckets]

    def _accumulated(self, p: torch.Tensor) -> None:
        view = self.views[id(p)]
        if p.grad.data_ptr() != view.data_ptr():  # autograd accumulates in place; just in case
            view.copy_(p.grad)
            p.grad = view
        if not self.armed and self._ask is None:
            return
        bucket = self.bucket_of[id(p)]
        self.pending[bucket] -= 1
        if self._ask is not None and self.pending[bucket] <= 0:
            (is_last, group_of), self._ask = self._ask, None
            if is_last():
                self._armed_over(group_of())
        if not self.armed or self.group is None:
            return
        while len(self.works) < len(self.buckets) and self.pending[len(self.works)] <= 0:
            self._launch(len(self.works))
            self.launched_in_backward += 1

    def _launch(self, index: int) -> None:
        if self.over_trees:
            self.works.append(self._tree_thread.submit(self.buffers[index]))
        else:
            self.works.append(all_reduce_async(self.buffers[index], self.group))

    @property
    def over_trees(self) -> bool:
        """Whether this iteration's sum goes along the plan's trees (over the whole stage)."""
        return self.trees is not None and self.group is self.trees_group

    def finish(self, group) -> tuple[float, float]:
        """Launch the rest over ``group`` (the one given to :meth:`arm`, if armed), wait for all;
        returns ``(wait_s, comm_s)``: seconds until the first bucket was summed (the peers'
        arrival dominates it), then the rest."""
        for p in self.params:  # a parameter backward never reached keeps its zero view
            if p.grad is None:
                p.grad = self.views[id(p)]
        self.group, self._ask = group, None
        if self.group is None:
            self.armed = False
            return 0.0, 0.0
        while len(self.works) < len(self.buckets):
            self._launch(len(self.works))
        start = time.perf_counter()
        self.works[0].wait()
        first = time.perf_counter()
        for work in self.works[1:]:
            work.wait()
        self.armed = False
        return first - start, time.perf_counter() - first
