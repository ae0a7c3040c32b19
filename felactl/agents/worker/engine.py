"""The trainer inside one worker: its part of the model, its optimizer, and compute over samples.

Gradients are weighted by samples: every micro-batch's mean loss is scaled by
``samples / global_batch`` before ``backward``, so the sum over all workers of their accumulated
gradients is exactly the gradient of the global batch's mean loss, however the samples were
divided (uneven shares, tokens pulled at different speeds). A sum-allreduce then gives every
replica the single-process gradient: BSP semantics.

The user's :class:`felactl.TrainJob` sits behind these methods: :meth:`Trainer.batch` is its
``collate_fn`` over its ``dataset``, :meth:`Trainer.compute` its ``loss_fn`` (under its autocast),
:meth:`Trainer.optimizer_step` its clipping, optimizer and LR scheduler. What a step needs to know
about who is in the job, the trainer asks its worker's membership (:mod:`.membership_view`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from felactl import models
from felactl.agents.worker.checkpoint import (
    checkpoint_not_written,
    checkpoint_path,
    drop_other_shards,
    parameter_aliases,
    restore_stage,
    save_checkpoint,
    save_shards,
    stage_state,
)
from felactl.agents.worker.clipping import clip_gradients
from felactl.agents.worker.drain import Drain
from felactl.agents.worker.membership_view import MembershipView
from felactl.agents.worker.runtime import Runtime
from felactl.agents.worker.stages import Placement, held_stages, micro_batches, place
from felactl.agents.worker.stragglers import Straggler
from felactl.agents.worker.tied import tied_weights
from felactl.agents.worker.waits import Waits
from felactl.control.metrics import MetricsWriter
from felactl.errors import InputError
from felactl.fsutil import STORAGE_ERRORS, atomic_write_text
from felactl.job import TrainJob
from felactl.models import values
from felactl.parallel.fsdp import SHARDS, is_sharded, local, shard
from felactl.spec import Plan

log = logging.getLogger(__name__)


def make_optimizer(plan: Plan, params, job: TrainJob | None = None) -> torch.optim.Optimizer:
    """The job's own optimizer where it has a factory; else the plan's ``training`` (sgd or adamw
    at ``training.lr``): the built-ins' way, so their plans choose it."""
    if job is not None and job.optimizer is not None:
        optimizer = job.optimizer(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"TrainJob.optimizer: must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
        return optimizer
    if plan.training.optimizer == "sgd":
        return torch.optim.SGD(params, lr=plan.training.lr)
    return torch.optim.AdamW(params, lr=plan.training.lr)


@dataclass
class Part:
    """A stage's layers as this worker holds them: the module, its optimizer, and the ranks that
    hold the same stage (its replicas, in the stage's order: the first one writes checkpoints),
    and the job's LR scheduler of that optimizer, if it has one."""

    stage: int
    module: nn.Module
    optimizer: torch.optim.Optimizer
    ranks: tuple[int, ...]
    scheduler: Any = None


@dataclass
class ComputeResult:
    loss_sum: float
    """Sum over samples of the per-sample loss (divide by ``samples`` for the mean)."""
    samples: int
    compute_s: float
    waited_s: float = 0.0


class Trainer(Waits):
    def __init__(
        self,
        runtime: Runtime,
        plan: Plan,
        *,
        membership: MembershipView,
        bundle: models.ModelBundle | None = None,
        metrics_rank: int | None = None,
    ):
        """``membership``: the worker's (what the trainer and its strategy ask about who is in the
        job); ``bundle``: the model already built (a newcomer builds it before it knows its rank);
        ``metrics_rank``: the id its metrics carry (an elastic worker's stable id), default the rank."""
        self.runtime = runtime
        self.plan = plan
        self.membership = membership
        self.placement: Placement = place(plan, runtime.rank)
        stage = plan.stages[self.placement.stage]
        self.micro_batch = stage.micro_batch
        self.bundle = bundle or models.build(plan.model.source, plan.model.config, seed=plan.training.seed)
        if self.bundle.job is None:
            raise InputError(
                f"model {plan.model.source!r} returns layers, not a felactl.TrainJob: "
                "felactl can profile it but not train it"
            )
        owned: set[int] = set()  # a weight two held stages share (tied) is stepped by the first's optimizer
        self.parts = [self._part(s, owned) for s in held_stages(plan, runtime.rank)]
        home = next(part for part in self.parts if part.stage == self.placement.stage)
        self.model: nn.Module = home.module
        self.params = [p for p in self.model.parameters()]
        self.optimizer = home.optimizer
        self.scheduler = home.scheduler
        self.tied = tied_weights(plan, self.bundle)
        self.start_step, self.start_position = 0, 0
        """Where this run starts: 0, or the checkpoint a resume restored (:meth:`restore`)."""
        self.steps_done, self.data_position = 0, 0
        """The last completed step (steps done) and the data position after it."""
        self.checkpointed_at: int | None = None
        # The job's store, not a generation's: a drain asked before a rescale reaches every member
        self.drain = Drain(runtime.cfg.reader(runtime._raw), membership.drain_key)
        cfg = runtime.cfg
        self.straggler = Straggler(cfg.rank, cfg.world_size, cfg.slowdown, cfg.pattern, seed=plan.training.seed)
        self.worker_id = cfg.rank if metrics_rank is None else metrics_rank
        self.metrics = MetricsWriter(cfg.run_dir, self.worker_id, self.placement.stage)
        self.totals = {"samples": 0, "tokens": 0, "compute_s": 0.0, "comm_s": 0.0, "wait_s": 0.0, "steps": 0}

    @property
    def job(self) -> TrainJob:
        return self.bundle.job

    def _part(self, stage_index: int, owned: set[int]) -> Part:
        stage, plan = self.plan.stages[stage_index], self.plan
        whole = len(plan.stages) == 1  # the user's module itself, however many layers its profile has
        module = self.bundle.stage_module(stage.layer_start, stage.layer_end, whole=whole).to(self.runtime.device)
        if stage.shard:  # split among the stage's workers before its optimizer takes the shards
            # block by block; a split model's stage runs its traced graph, no block: gathered whole
            units = self.bundle.split_points if module is self.bundle.model else ()
            module = shard(module, self.runtime.group(self.placement.stage_ranks), self.runtime.device, units)
        params = [p for p in module.parameters() if id(p) not in owned]
        owned.update(id(p) for p in params)
        optimizer = make_optimizer(plan, params, self.job)
        scheduler = self.job.lr_scheduler(optimizer) if self.job.lr_scheduler is not None else None
        return Part(
            stage_index,
            module,
            optimizer,
            tuple(plan.rank_of(d) for d in stage.devices)
            if stage_index != self.placement.stage
            else self.placement.stage_ranks,
            scheduler,
        )

    # --- the run's start: the same state on every replica ------------------------------------
    def begin(self) -> None:
        """Restore the checkpoint a resume names, then give every replica of each stage its first
        replica's parameters and buffers (collective over each stage's group: call it on every
        rank, after the groups exist)."""
        self.restore()
        self.sync_replicas()

    def restore(self) -> None:
        """Load this worker's stages from ``FELACTL_RESUME_FROM`` (a checkpoint directory, or a
        stage file in it): parameters, optimizer state, step and data position."""
        source = self.runtime.cfg.resume_from
        if source is None:
            return
        directory = source if source.is_dir() else source.parent
        aliases = parameter_aliases(self.bundle.model)
        states = [
            restore_stage(directory, part.stage, self._layers(part), part.module, part.optimizer, aliases)
            for part in self.parts
        ]
        for part, state in zip(self.parts, states):
            if part.scheduler is not None and "lr_scheduler" in state:
                part.scheduler.load_state_dict(state["lr_scheduler"])
        self.start_at(int(states[0]["step"]), int(states[0]["data_position"]))
        self.checkpointed_at = self.start_step

    def start_at(self, step: int, data_position: int) -> None:
        """Go on from ``step`` (steps done) at ``data_position``: a resume's checkpoint, or the
        state a new generation's members agreed on (a newcomer holds none yet: step -1)."""
        self.start_step = self.steps_done = step
        self.start_position = self.data_position = data_position

    def adopt_position(self, data_position: int) -> None:
        """The run reached ``data_position`` (a mode at its own pace: its claimed samples are
        trained); such modes keep a fixed global batch, so a step is ``position // batch``."""
        self.data_position = data_position
        self.steps_done = data_position // self.global_batch

    def sync_replicas(self, buffers_only: bool = False) -> None:
        """felactl never re-initialises what the user's model holds; it makes the replicas agree
        with the first one of their stage instead (parameters and buffers, one broadcast each).
        ``buffers_only``: after a step, the buffers (a BatchNorm's running statistics, which each
        replica updates from its own samples) follow the first replica's, as DDP's
        ``broadcast_buffers`` has them; a model without buffers pays nothing."""
        for part in self.parts:
            # a sharded stage's weights were made equal before they were split (parallel.fsdp.shard)
            params_too = not buffers_only and not is_sharded(part.module)
            tensors = [*(part.module.parameters() if params_too else []), *part.module.buffers()]
            if len(part.ranks) < 2 or not tensors:
                continue
            group = self.runtime.group(part.ranks)
            with torch.no_grad():
                for tensor in tensors:
                    dist.broadcast(tensor.data, src=part.ranks[0], group=group)

    def rebind(self, runtime: Runtime, plan: Plan) -> None:
        """Take a new generation's place (rank, shares, batch) keeping the model and optimizer:
        a rescale re-plans data parallelism only, so this rank's layers stay the same."""
        self.runtime, self.plan = runtime, plan
        self.placement = place(plan, runtime.rank)
        self.micro_batch = plan.stages[self.placement.stage].micro_batch
        self.parts = [dataclasses.replace(part, ranks=self.placement.stage_ranks) for part in self.parts]
        cfg = runtime.cfg
        self.straggler = Straggler(cfg.rank, cfg.world_size, cfg.slowdown, cfg.pattern, seed=plan.training.seed)

    def apply_plan_lr(self, plan: Plan) -> None:
        """Give the optimizer the plan's ``training.lr`` (the scaling policy's rate for this
        membership), where the plan chose the optimizer; a job's own optimizer and scheduler keep
        their rates."""
        if self.job.optimizer is None and self.scheduler is None:
            for group in self.optimizer.param_groups:
                group["lr"] = plan.training.lr

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The job's ``collate_fn([dataset[i] for i in indices])``, on this worker's device."""
        inputs, targets = self.job.batch(list(indices))
        return values.to_device(inputs, self.runtime.device), values.to_device(targets, self.runtime.device)

    def autocast(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` under the job's autocast (bf16 on CUDA workers where it asks): a stage's
        forward and the loss, whatever the plan's shape."""
        with self.job.autocast(self.runtime.device):
            return fn(*args)

    def compute(
        self,
        indices: Sequence[int],
        weight_by: int | None = None,
        ddp=None,
        before_last: Callable[[], float] | None = None,
    ) -> ComputeResult:
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
                with self.job.autocast(self.runtime.device):
                    loss = self.job.loss_fn(module(inputs), targets)
                (loss * (len(chunk) * scale / weight_by)).backward()
            loss_sum += loss.item() * len(chunk)
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)
        compute_s = time.perf_counter() - start - waited_s
        compute_s += self.straggler.after_compute(compute_s)
        return ComputeResult(loss_sum, len(indices), compute_s, waited_s)

    def position_of(self, step: int) -> int:
        """The data position where step ``step`` (0-based) of a synchronous mode begins."""
        return self.start_position + (step - self.start_step) * self.global_batch

    def step_indices(self, step: int, offsets: Sequence[int]) -> list[int]:
        begin = self.position_of(step)
        return [begin + o for o in offsets]

    def flat_grads(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    def set_flat_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p)
            offset += n

    def flat_params(self) -> torch.Tensor:
        """The parameters this worker holds, flat (of a sharded stage, its shards)."""
        return nn.utils.parameters_to_vector([local(p) for p in self.params]).detach().clone()

    def set_flat_params(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` into the parameters' own storage. (``vector_to_parameters`` would make
        the parameters views of ``flat``: a caller keeping ``flat`` would see it change under the
        optimizer, which is how WBSP once sent zero deltas.)"""
        with torch.no_grad():
            offset = 0
            for param in self.params:
                size = param.numel()
                param.copy_(flat[offset : offset + size].view_as(param))
                offset += size

    def optimizer_step(self, at_step: int | None = None) -> None:
        """After the gradients are summed: clip them to the job's ``max_grad_norm``, step every
        stage this worker holds, then its LR scheduler, and clear the gradients.

        The scheduler follows global steps. A mode at its own pace passes the global step its
        samples are in (``at_step``): a worker makes as many local steps as its speed allows, so
        its scheduler is brought to that step before the update instead of stepped after it."""
        if self.job.max_grad_norm is not None:
            self.clip_gradients(self.job.max_grad_norm, across_stages=at_step is None)
        for part in self.parts:
            if at_step is not None and part.scheduler is not None:
                _advance_scheduler(part.scheduler, at_step)
            part.optimizer.step()
            if at_step is None and part.scheduler is not None:
                part.scheduler.step()
            part.optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self, max_norm: float, across_stages: bool = True) -> float:
        """:func:`~felactl.agents.worker.clipping.clip_gradients` of this worker's stages."""
        return clip_gradients(self, max_norm, across_stages)

    def record(
        self,
        *,
        step: int,
        samples: int,
        loss_sum: float | None,
        compute_s: float,
        comm_s: float,
        wait_s: float,
        duration_s: float,
        loss_samples: int | None = None,
        **extra,
    ) -> None:
        """``loss_samples``: the samples ``loss_sum`` is over, where not ``samples`` (a flexible hybrid's
        worker): recorded, the weight of its loss (:func:`~felactl.control.metrics.step_losses`)."""
        extra.update({"loss_samples": loss_samples} if loss_samples not in (None, samples) else {})
        loss_samples = samples if loss_samples is None else loss_samples
        loss = loss_sum / loss_samples if loss_samples and loss_sum is not None else None
        self.metrics.write(
            step=step,
            samples=samples,
            loss=loss,
            compute_s=compute_s,
            comm_s=comm_s,
            wait_s=wait_s,
            duration_s=duration_s,
            **extra,
        )
        t = self.totals
        t["samples"] += samples
        t["tokens"] += extra.get("tokens", 0)
        t["compute_s"] += compute_s
        t["comm_s"] += comm_s
        t["wait_s"] += wait_s
        t["steps"] += 1
        t["last_loss"] = loss

    # --- checkpoints and the end of a step --------------------------------------------------
    def end_step(self, step: int, lead_steps: int) -> bool:
        """Step ``step`` (0-based) of a synchronous mode completed: checkpoint every
        ``--checkpoint-every`` steps; True when a graceful stop ends the run here (a stop asked
        now ends ``lead_steps`` steps on, the strategy's :attr:`Strategy.lead_steps`)."""
        self.steps_done, self.data_position = step + 1, self.position_of(step + 1)
        self.sync_replicas(buffers_only=True)
        every = self.runtime.cfg.checkpoint_every
        if every and self.steps_done % every == 0:
            self.checkpoint()
        return self.drain.stop_after(self.steps_done, lead_steps)

    def end_local_step(self, indices: Sequence[int]) -> None:
        """A local step of a mode at its own pace (WBSP, SDPipe) trained ``indices``: checkpoint
        when its data crosses a multiple of ``--checkpoint-every`` global batches."""
        end = indices[-1] + 1
        every_samples = self.runtime.cfg.checkpoint_every * self.global_batch
        crossed = every_samples and end // every_samples > self.data_position // every_samples
        self.data_position = max(self.data_position, end)
        self.steps_done = self.data_position // self.global_batch
        if crossed:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Write the stages this worker is the first replica of, at ``steps_done``. One the
        storage cannot take is a warning and an event, never the worker's failure: it is not
        counted as taken, so the next one (or the run's last) is tried."""
        written = True
        for part in self.parts:
            if is_sharded(part.module):
                written = self.write_shards(part) and written
            elif self.runtime.rank == part.ranks[0]:
                written = self.write_checkpoint(part, stage_state(part.module, part.optimizer)) and written
        if written:
            self.checkpointed_at = self.steps_done

    def write_shards(self, part: Part) -> bool:
        """Write this worker's shards of the sharded ``part`` (every worker of its stage together),
        then, the stage's first worker, the stage file naming them; False: not written."""
        path = checkpoint_path(self.runtime.cfg.run_dir, self.steps_done, part.stage)
        try:
            shards = save_shards(path, part.module, part.optimizer)
        except STORAGE_ERRORS as exc:
            checkpoint_not_written(
                self.runtime.cfg.events, worker=self.worker_id, step=self.steps_done, path=path, exc=exc
            )
            return False
        if shards is None:
            return True  # the stage's first worker names them
        written = self.write_checkpoint(part, None, **{SHARDS: shards})
        if written:
            drop_other_shards(path, keep=shards)
        return written

    def write_checkpoint(self, part: Part, state: tuple[dict, dict] | None, steps: int | None = None, **extra) -> bool:
        """Write ``part``'s ``state`` (None: a sharded stage's, its shards named in ``extra``) as the
        checkpoint of ``steps`` (default: the steps done); False: not written."""
        cfg, steps = self.runtime.cfg, self.steps_done if steps is None else steps
        path = checkpoint_path(cfg.run_dir, steps, part.stage)
        scheduler = {} if part.scheduler is None else {"lr_scheduler": part.scheduler.state_dict()}
        try:
            save_checkpoint(
                path,
                state=state,
                step=steps,
                data_position=self.data_position if steps == self.steps_done else self.position_of(steps),
                layers=self._layers(part),
                extra={**self.membership.checkpoint_extra(), **scheduler, **extra},
            )
        except STORAGE_ERRORS as exc:
            checkpoint_not_written(cfg.events, worker=self.worker_id, step=steps, path=path, exc=exc)
            return False
        return True

    def _layers(self, part: Part) -> tuple[int, int]:
        return self.plan.stages[part.stage].layer_start, self.plan.stages[part.stage].layer_end

    def final_checkpoint(self) -> None:
        """The run's last completed step (its end, or where a graceful stop ended it), whatever
        ``--checkpoint-every`` says: no completed step is lost."""
        if self.steps_done > 0 and self.checkpointed_at != self.steps_done:
            self.checkpoint()

    def finish(self, wall_s: float, extra: dict[str, Any] | None = None) -> None:
        """Write this worker's summary (``workers/rank<R>.json``, with ``extra``) and close the
        metrics file."""
        summary = {
            "rank": self.worker_id,
            "stage": self.placement.stage,
            "wall_s": wall_s,
            "sync": self.plan.sync.mode.value,
            "device": str(self.runtime.device),
            "param_checksum": float(self.flat_params().double().sum()),
            "params_held": self.flat_params().numel(),  # of a sharded stage, its shards
            "buffer_checksum": sum(float(b.double().sum()) for part in self.parts for b in part.module.buffers()),
            **self.totals,
            **(extra or {}),
        }
        path = self.runtime.cfg.run_dir / "workers" / f"rank{self.worker_id}.json"
        try:
            atomic_write_text(path, json.dumps(summary, indent=2) + "\n")
        except STORAGE_ERRORS as exc:  # the run's results are its metrics and checkpoints: say it, end well
            log.warning("worker %d: its summary %s was not written (%s)", self.worker_id, path, exc)
        self.metrics.close()


def _advance_scheduler(scheduler, step: int) -> None:
    """Step ``scheduler`` until it stands at ``step`` (never back)."""
    with warnings.catch_warnings():  # a worker's first update may come after a few global steps
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        while scheduler.last_epoch < step:
            scheduler.step()
