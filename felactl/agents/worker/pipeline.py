"""Static pipelines: each replica (``plan.pipelines[r]``) runs the stages on its devices, micro-
batches flow forward as activations and backward as gradients over torch.distributed
point-to-point, in the 1F1B or GPipe order; then each stage's replicas sum-allreduce their
gradients (BSP), and weights two stages hold (tied embeddings) sum theirs over those stages, so the
result equals single-process training on the same global batches. What crosses a boundary is what
the model passes there: one tensor between an ``nn.Sequential``'s layers, any tuple of tensors and
numbers between a split model's (:mod:`felactl.models.split`).

Why plain ``isend``/``recv`` and not ``torch.distributed.pipelining``: the plan gives every stage
its own layer range of an ``nn.Sequential`` and every replica its own share of samples, and the
schedules here are a few lines; ``pipelining`` wants to own the model split, the loss and the
schedule object, which would hide the per-stage timings that metrics report. Sends carry a small
shape header first, so micro-batches of any size (the last one may be short) need no agreement.
The last stage reads its micro-batches' targets from the data itself (any worker can fetch any
sample), so labels never travel.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from felactl.agents.worker import wire
from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.stages import micro_batches, stage_rank_sets
from felactl.agents.worker.strategy import AtOwnPace, Lockstep, StepResult, Work
from felactl.agents.worker.survivors import KeptState
from felactl.agents.worker.sync.bsp import allreduce_grads, arrive
from felactl.agents.worker.sync.sdpipe import SDPipeSync
from felactl.agents.worker.sync.trees import stage_trees
from felactl.agents.worker.tied import check_sharded_ties, sum_tied_grads
from felactl.models import values
from felactl.parallel.fsdp import sum_gradients
from felactl.spec import Schedule

TAG_ACTIVATION, TAG_GRADIENT, TAG_CHUNK = 21, 22, 23


def one_f_one_b(num_stages: int, stage: int, num_micro: int) -> list[tuple[str, int]]:
    """1F1B: ``num_stages - stage - 1`` warm-up forwards, then alternate, then drain backwards."""
    warmup = min(num_stages - stage - 1, num_micro)
    order = [("F", i) for i in range(warmup)]
    backward = 0
    for i in range(warmup, num_micro):
        order += [("F", i), ("B", backward)]
        backward += 1
    order += [("B", i) for i in range(backward, num_micro)]
    return order


def gpipe(num_micro: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(num_micro)] + [("B", i) for i in range(num_micro)]


class _Link:
    """Point-to-point to one neighbour, in :mod:`~felactl.agents.worker.wire`'s messages."""

    def __init__(self, peer: int, device: torch.device):
        self.peer, self.device = peer, device
        self.pending: list = []

    def send(self, value, tag: int) -> None:
        """Send a tensor, or a tuple of tensors and numbers (:mod:`~felactl.agents.worker.wire`)."""
        for tensor in wire.encode(value):
            tensor = tensor.to(self.device)
            self.pending.append((dist.isend(tensor, self.peer, tag=tag), tensor))

    def recv(self, tag: int) -> tuple[Any, float]:
        """The next message, and the seconds until its first part came: the wait for the peer to
        send it. The rest of the time the message took is its transfer."""
        first_s: list[float] = []

        def receive(buffer: torch.Tensor) -> None:
            start = time.perf_counter()
            dist.recv(buffer, self.peer, tag=tag)
            if not first_s:
                first_s.append(time.perf_counter() - start)

        return wire.decode(receive, self.device), first_s[0]

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []


class PipelineStep:
    """One iteration of this rank's stage over its replica's micro-batches."""

    def __init__(self, trainer: Trainer, prev: _Link | None, next: _Link | None):
        self.trainer = trainer
        self.prev, self.next = prev, next
        self.weight_by = trainer.global_batch
        self.compute_s = self.comm_s = self.wait_s = self.loss_sum = 0.0
        self.saved: dict[int, tuple] = {}

    def _timed(self, fn):
        start = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - start
        self.compute_s += elapsed + self.trainer.straggler.after_compute(elapsed)
        return out

    def _recv(self, link: _Link, tag: int) -> torch.Tensor:
        """A neighbour's message: waiting for it to be sent counts as wait, its transfer as comm
        (a stage's activations and gradients are what a pipeline communicates)."""
        start = time.perf_counter()
        value, waited_s = link.recv(tag)
        self.wait_s += waited_s
        self.comm_s += time.perf_counter() - start - waited_s
        return value

    def forward(self, indices: list[int]) -> tuple:
        t = self.trainer
        if self.prev is None or self.next is None:
            inputs, targets = t.batch(indices)
        x = inputs if self.prev is None else values.cut_from_graph(self._recv(self.prev, TAG_ACTIVATION), True)
        y = self._timed(lambda: t.autocast(t.model, x))
        if self.next is None:
            loss = self._timed(lambda: t.autocast(t.bundle.loss, y, targets))
            self.loss_sum += loss.item() * len(indices)
            return x, loss * (len(indices) / self.weight_by)
        self.next.send(y, TAG_ACTIVATION)
        return x, y

    def backward(self, x, out) -> None:
        """Backward of a micro-batch; ``x`` and ``out``: what the stage took and gave (a tensor,
        or a split model's tuple of values: one gradient travels per floating-point tensor)."""
        if self.next is None:
            self._timed(out.backward)
        else:
            grads = self._recv(self.next, TAG_GRADIENT)
            self._timed(lambda: values.backward(out, list(grads)))
        if self.prev is not None:
            self.prev.send(tuple(values.input_grads(x)), TAG_GRADIENT)

    def run(self, indices: list[int], weight_by: int, sharded: bool = False) -> None:
        """Forward and backward ``indices`` through the pipeline; losses weighted by ``weight_by``.
        ``sharded``: the stage's gradients are reduce-scattered in its last backward only (FSDP2
        accumulates the others' unreduced)."""
        t = self.trainer
        self.weight_by = weight_by
        micro_batch = t.plan.stages[0].micro_batch  # one micro-batch size along a static pipeline
        chunks = [[indices[i] for i in m] for m in micro_batches(range(len(indices)), micro_batch)]
        num_stages = len(t.plan.stages)
        order = (
            gpipe(len(chunks))
            if t.plan.schedule is Schedule.GPIPE
            else one_f_one_b(num_stages, t.placement.stage, len(chunks))
        )
        sync = t.model.set_requires_gradient_sync if sharded else lambda _on: None
        sync(False)
        for n, (op, i) in enumerate(order):
            if op == "F":
                self.saved[i] = self.forward(chunks[i])
            else:
                sync(n == len(order) - 1)
                self.backward(*self.saved.pop(i))
        for link in (self.prev, self.next):
            if link is not None:
                link.flush()


def links(trainer: Trainer) -> tuple[_Link | None, _Link | None]:
    p, device = trainer.placement, trainer.runtime.device
    return (
        _Link(p.prev_rank, device) if p.prev_rank is not None else None,
        _Link(p.next_rank, device) if p.next_rank is not None else None,
    )


class Pipeline(Lockstep):
    """Static pipelines (1F1B or GPipe inside each step); each stage's replicas sum their
    gradients (along the plan's trees where it has them) before the optimizer step."""

    def __init__(self, trainer: Trainer):
        super().__init__(trainer)
        placement = trainer.placement
        self.group = trainer.runtime.group(placement.stage_ranks)
        self.prev, self.next = links(trainer)
        self.trees = stage_trees(trainer.plan, placement.stage, trainer.runtime.rank, self.group)
        self.sharded = trainer.plan.stages[placement.stage].shard  # FSDP2 sums the stage's gradients
        self.replicated = len(placement.stage_ranks) > 1 and not self.sharded
        check_sharded_ties(trainer.plan, trainer.tied)
        if self.sharded:
            sum_gradients(trainer.model)
        self.kept = KeptState(trainer)

    def step(self, work: Work) -> StepResult:
        t = self.trainer
        it = PipelineStep(t, self.prev, self.next)
        it.run(list(work.indices), t.global_batch, self.sharded)
        wait_s = it.wait_s + (arrive(self.group, t.runtime.device)[0] if self.replicated else 0.0)
        comm_s = it.comm_s + (allreduce_grads(t, self.group, self.trees) if self.replicated else 0.0)
        comm_s += sum_tied_grads(t, t.tied)
        committed = self.kept.optimizer_step(work.step)
        return StepResult(
            len(t.placement.offsets),
            it.loss_sum if t.placement.is_last else None,
            it.compute_s,
            comm_s,
            wait_s + committed.get("commit_s", 0.0),
            extra=committed,
        )

    def kept_state(self) -> KeptState:
        return self.kept


class PipelineSDPipe(AtOwnPace):
    """SDPipe proper: S stages x N pipelines, 1F1B inside each, no waiting for other pipelines;
    after each local step a stage's worker averages with the group its stage's scheduler forms."""

    def __init__(self, trainer: Trainer):
        super().__init__(trainer)
        self.sdpipe = SDPipeSync(trainer, stage_rank_sets(trainer.plan))
        self.prev, self.next = links(trainer)

    def claim(self) -> list[int]:
        """The first stage claims the pipeline's next samples from the store counter and hands
        ``[start, count]`` down its pipeline (count 0: the data is done)."""
        device = self.trainer.runtime.device  # the default group may be NCCL: tensors on the device
        if self.prev is None:
            indices = super().claim()
            header = torch.tensor([indices[0] if indices else 0, len(indices)], device=device)
        else:
            header = torch.zeros(2, dtype=torch.long, device=device)
            dist.recv(header, self.prev.peer, tag=TAG_CHUNK)
        if self.next is not None:
            dist.send(header, self.next.peer, tag=TAG_CHUNK)
        start, count = int(header[0]), int(header[1])
        return list(range(start, start + count))

    def step(self, work: Work) -> StepResult:
        t = self.trainer
        it = PipelineStep(t, self.prev, self.next)
        it.run(list(work.indices), len(work.indices))
        t.optimizer_step(at_step=work.step)
        comm_s, wait_s = self.sdpipe.sync()
        return StepResult(
            len(work.indices),
            it.loss_sum if t.placement.is_last else None,
            it.compute_s,
            comm_s + it.comm_s,
            wait_s + it.wait_s,
        )

    def finish(self) -> None:
        self.sdpipe.finish()
        super().finish()
