"""Static pipelines: each replica (``plan.pipelines[r]``) runs the stages on its devices, micro-
batches flow forward as activations and backward as gradients over torch.distributed
point-to-point, in the 1F1B or GPipe order; then each stage's replicas sum-allreduce their
gradients (BSP), so the result equals single-process training on the same global batches.

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

import torch
import torch.distributed as dist

from felactl.agents.worker.engine import Trainer
from felactl.agents.worker.stages import micro_batches
from felactl.agents.worker.sync.bsp import allreduce_grads, arrive
from felactl.spec import Schedule

TAG_ACTIVATION, TAG_GRADIENT = 21, 22
MAX_DIMS = 7


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
    """Point-to-point to one neighbour: shape header, then the tensor."""

    def __init__(self, peer: int, device: torch.device):
        self.peer, self.device = peer, device
        self.pending: list = []

    def send(self, tensor: torch.Tensor, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        header = torch.zeros(MAX_DIMS + 1, dtype=torch.long)
        header[0] = tensor.dim()
        header[1:1 + tensor.dim()] = torch.tensor(tensor.shape)
        self.pending += [(dist.isend(header.to(self.device), self.peer, tag=tag), header),
                         (dist.isend(tensor, self.peer, tag=tag), tensor)]

    def recv(self, tag: int) -> torch.Tensor:
        header = torch.zeros(MAX_DIMS + 1, dtype=torch.long, device=self.device)
        dist.recv(header, self.peer, tag=tag)
        header = header.cpu()
        tensor = torch.empty(tuple(header[1:1 + int(header[0])].tolist()), device=self.device)
        dist.recv(tensor, self.peer, tag=tag)
        return tensor

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []


class PipelineStep:
    """One iteration of this rank's stage over its replica's micro-batches."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        p = trainer.placement
        device = trainer.runtime.device
        self.prev = _Link(p.prev_rank, device) if p.prev_rank is not None else None
        self.next = _Link(p.next_rank, device) if p.next_rank is not None else None
        self.compute_s = self.wait_s = self.loss_sum = 0.0
        self.saved: dict[int, tuple] = {}

    def _timed(self, fn):
        start = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - start
        self.compute_s += elapsed + self.trainer.straggler.after_compute(elapsed)
        return out

    def _recv(self, link: _Link, tag: int) -> torch.Tensor:
        start = time.perf_counter()
        tensor = link.recv(tag)
        self.wait_s += time.perf_counter() - start
        return tensor

    def forward(self, indices: list[int]) -> tuple:
        t = self.trainer
        if self.prev is None or self.next is None:
            inputs, targets = t.batch(indices)
        x = inputs if self.prev is None else self._recv(self.prev, TAG_ACTIVATION).requires_grad_()
        y = self._timed(lambda: t.model(x))
        if self.next is None:
            loss = self._timed(lambda: t.bundle.loss(y, targets))
            self.loss_sum += loss.item() * len(indices)
            return x, loss * (len(indices) / t.global_batch)
        self.next.send(y, TAG_ACTIVATION)
        return x, y

    def backward(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.next is None:
            self._timed(out.backward)
        else:
            grad = self._recv(self.next, TAG_GRADIENT)
            self._timed(lambda: out.backward(grad))
        if self.prev is not None:
            self.prev.send(x.grad, TAG_GRADIENT)

    def run(self, step: int) -> None:
        t = self.trainer
        micro_batch = t.plan.stages[0].micro_batch  # one micro-batch size along a static pipeline
        chunks = [t.step_indices(step, m) for m in micro_batches(t.placement.offsets, micro_batch)]
        num_stages = len(t.plan.stages)
        order = gpipe(len(chunks)) if t.plan.schedule is Schedule.GPIPE else \
            one_f_one_b(num_stages, t.placement.stage, len(chunks))
        for op, i in order:
            if op == "F":
                self.saved[i] = self.forward(chunks[i])
            else:
                self.backward(*self.saved.pop(i))
        for link in (self.prev, self.next):
            if link is not None:
                link.flush()


def run(trainer: Trainer) -> None:
    placement = trainer.placement
    group = trainer.runtime.group(placement.stage_ranks)
    device = trainer.runtime.device
    for step in range(trainer.runtime.cfg.steps):
        start = time.perf_counter()
        pattern_s = trainer.straggler.at_iteration(step)
        it = PipelineStep(trainer)
        it.run(step)
        wait_s = it.wait_s + (arrive(group, device) if len(placement.stage_ranks) > 1 else 0.0)
        comm_s = allreduce_grads(trainer, group) if len(placement.stage_ranks) > 1 else 0.0
        trainer.optimizer_step()
        samples = len(placement.offsets)
        trainer.record(step=step, samples=samples, loss_sum=it.loss_sum if placement.is_last else None,
                       compute_s=it.compute_s + pattern_s, comm_s=comm_s, wait_s=wait_s,
                       duration_s=time.perf_counter() - start)
        trainer.maybe_checkpoint(step, (step + 1) * trainer.global_batch)
