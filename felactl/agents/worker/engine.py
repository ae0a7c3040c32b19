"""The trainer inside one worker: its part of the model, its optimizer, and compute over samples.

Gradients are weighted by samples: every micro-batch's mean loss is scaled by
``samples / global_batch`` before ``backward``, so the sum over all workers of their accumulated
gradients is exactly the gradient of the global batch's mean loss, however the samples were
divided (uneven shares, tokens pulled at different speeds). A sum-allreduce then gives every
replica the single-process gradient: BSP semantics.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from felactl import models
from felactl.agents.worker.checkpoint import checkpoint_path, save_checkpoint
from felactl.agents.worker.metrics import MetricsWriter
from felactl.agents.worker.stages import Placement, micro_batches, place
from felactl.agents.worker.stragglers import Straggler
from felactl.agents.worker.runtime import Runtime
from felactl.fsutil import atomic_write_text
from felactl.spec import Plan


def make_optimizer(plan: Plan, params) -> torch.optim.Optimizer:
    if plan.training.optimizer == "sgd":
        return torch.optim.SGD(params, lr=plan.training.lr)
    return torch.optim.AdamW(params, lr=plan.training.lr)


@dataclass
class ComputeResult:
    loss_sum: float
    """Sum over samples of the per-sample loss (divide by ``samples`` for the mean)."""
    samples: int
    compute_s: float
    waited_s: float = 0.0


class Trainer:
    def __init__(self, runtime: Runtime, plan: Plan, bundle: models.ModelBundle | None = None,
                 metrics_rank: int | None = None):
        """``bundle``: the model already built (a newcomer builds it before it knows its rank);
        ``metrics_rank``: the id its metrics carry (an elastic worker's stable id), default the rank."""
        self.runtime = runtime
        self.plan = plan
        self.placement: Placement = place(plan, runtime.rank)
        stage = plan.stages[self.placement.stage]
        self.micro_batch = stage.micro_batch
        self.bundle = bundle or models.build(plan.model.source, plan.model.config, seed=plan.training.seed)
        self.model: nn.Module = self.bundle.layers[stage.layer_start:stage.layer_end].to(runtime.device)
        self.params = [p for p in self.model.parameters()]
        self.optimizer = make_optimizer(plan, self.params)
        cfg = runtime.cfg
        self.straggler = Straggler(cfg.rank, cfg.world_size, cfg.slowdown, cfg.pattern, seed=plan.training.seed)
        self.worker_id = cfg.rank if metrics_rank is None else metrics_rank
        self.metrics = MetricsWriter(cfg.run_dir, self.worker_id, self.placement.stage)
        self.totals = {"samples": 0, "tokens": 0, "compute_s": 0.0, "comm_s": 0.0, "wait_s": 0.0, "steps": 0}

    def rebind(self, runtime: Runtime, plan: Plan) -> None:
        """Take a new generation's place (rank, shares, batch) keeping the model and optimizer:
        a rescale re-plans data parallelism only, so this rank's layers stay the same."""
        self.runtime, self.plan = runtime, plan
        self.placement = place(plan, runtime.rank)
        self.micro_batch = plan.stages[self.placement.stage].micro_batch
        cfg = runtime.cfg
        self.straggler = Straggler(cfg.rank, cfg.world_size, cfg.slowdown, cfg.pattern, seed=plan.training.seed)

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.bundle.data.batch(list(indices))
        return inputs.to(self.runtime.device), targets.to(self.runtime.device)

    def compute(self, indices: Sequence[int], weight_by: int | None = None, ddp=None,
                before_last: Callable[[], float] | None = None) -> ComputeResult:
        """Forward and backward over ``indices`` (global sample ids) in micro-batches, accumulating
        gradients of ``loss_mean * n / weight_by`` (``weight_by`` defaults to ``len(indices)``, a
        plain local mean). Then the injected slowdown sleeps, counted as compute.

        With ``ddp`` (a ``DistributedDataParallel`` wrapper of this stage), only the last micro-batch
        synchronises, its allreduce overlapping the backward; the loss is multiplied by the group
        size because DDP averages and sample-weighted gradients must be summed. ``before_last`` runs
        just before the last micro-batch (the BSP arrival barrier); its seconds are not compute."""
        weight_by = weight_by or len(indices)
        module = ddp if ddp is not None else self.model
        scale = dist.get_world_size(ddp.process_group) if ddp is not None else 1
        chunks = micro_batches(range(len(indices)), self.micro_batch)
        start, waited_s, loss_sum = time.perf_counter(), 0.0, 0.0
        for k, chunk in enumerate(chunks):
            last = k == len(chunks) - 1
            if last and before_last is not None:
                waited_s = before_last()
            inputs, targets = self.batch([indices[i] for i in chunk])
            with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                loss = self.bundle.loss(module(inputs), targets)
                (loss * (len(chunk) * scale / weight_by)).backward()
            loss_sum += loss.item() * len(chunk)
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)
        compute_s = time.perf_counter() - start - waited_s
        compute_s += self.straggler.after_compute(compute_s)
        return ComputeResult(loss_sum, len(indices), compute_s, waited_s)

    def step_indices(self, step: int, offsets: Sequence[int]) -> list[int]:
        return [step * self.global_batch + o for o in offsets]

    def flat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p)
            offset += n

    def flat_params(self) -> torch.Tensor:
        return nn.utils.parameters_to_vector(self.params).detach().clone()

    def set_flat_params(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` into the parameters' own storage. (``vector_to_parameters`` would make
        the parameters views of ``flat``: a caller keeping ``flat`` would see it change under the
        optimizer, which is how WBSP once sent zero deltas.)"""
        with torch.no_grad():
            offset = 0
            for param in self.params:
                size = param.numel()
                param.copy_(flat[offset:offset + size].view_as(param))
                offset += size

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def record(self, *, step: int, samples: int, loss_sum: float | None, compute_s: float, comm_s: float,
               wait_s: float, duration_s: float, loss_samples: int | None = None, **extra) -> None:
        """``loss_samples``: the samples ``loss_sum`` is over, where not ``samples`` (a worker of the
        flexible hybrid may compute the first sub-model of some samples and the loss of others)."""
        loss_samples = samples if loss_samples is None else loss_samples
        loss = loss_sum / loss_samples if loss_samples and loss_sum is not None else None
        self.metrics.write(step=step, samples=samples, loss=loss, compute_s=compute_s, comm_s=comm_s,
                           wait_s=wait_s, duration_s=duration_s, **extra)
        t = self.totals
        t["samples"] += samples
        t["tokens"] += extra.get("tokens", 0)
        t["compute_s"] += compute_s
        t["comm_s"] += comm_s
        t["wait_s"] += wait_s
        t["steps"] += 1
        t["last_loss"] = loss

    def maybe_checkpoint(self, step: int, data_position: int) -> None:
        every = self.runtime.cfg.checkpoint_every
        if every and (step + 1) % every == 0 and self.runtime.rank == self.placement.stage_ranks[0]:
            save_checkpoint(checkpoint_path(self.runtime.cfg.run_dir, step + 1, self.placement.stage),
                            model=self.model, optimizer=self.optimizer, step=step + 1, data_position=data_position)

    def finish(self, wall_s: float) -> None:
        """Write this worker's summary (``workers/rank<R>.json``) and close the metrics file."""
        summary = {"rank": self.worker_id, "stage": self.placement.stage, "wall_s": wall_s,
                   "sync": self.plan.sync.mode.value, "param_checksum": float(self.flat_params().double().sum()),
                   **self.totals}
        atomic_write_text(self.runtime.cfg.run_dir / "workers" / f"rank{self.worker_id}.json",
                          json.dumps(summary, indent=2) + "\n")
        self.metrics.close()
