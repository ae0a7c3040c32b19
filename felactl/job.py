"""``felactl.TrainJob``: what a user's ``package.module:function`` returns for felactl to train.

felactl owns the data order (samples by global index), synchronisation, checkpoints and
membership; the job owns the model, the data, the loss and the optimizer. A batch is
``collate_fn([dataset[i % len(dataset)] for i in indices])``, which gives ``(inputs, targets)``;
the loss is ``loss_fn(model(inputs), targets)``, a mean over the batch's samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from felactl.errors import InputError

PRECISIONS = ("fp32", "bf16")

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


@dataclass(frozen=True, kw_only=True)
class TrainJob:
    model: nn.Module
    """Any module. Plans may cut it into pipeline stages where it is an ``nn.Sequential`` (its
    children are the layers), or has one list of blocks (a ``ModuleList``/``ModuleDict`` of
    same-class modules: HF's ``model.layers``, ``transformer.h``), or ``split_points`` names where
    stages may begin; then the embedding, each block and the head are the layers felactl profiles
    and plans (:mod:`felactl.models.split`). Any other module is one layer: data parallel only."""
    dataset: Any
    """A map-style dataset (``__getitem__`` and ``__len__``): felactl asks for samples by global
    index (wrapping around its length), so every run sees the same data in the same order."""
    loss_fn: Callable[[Any, Any], torch.Tensor]
    """``loss_fn(output, targets)``: the mean loss of a batch (felactl weights it by samples)."""
    collate_fn: Callable[[list], Sequence] = default_collate
    """Samples -> ``(inputs, targets)``; inputs go to ``model``, targets to ``loss_fn``."""
    optimizer: OptimizerFactory | None = None
    """``optimizer(parameters)`` -> any ``torch.optim.Optimizer``, called once per stage a worker
    holds. None: the plan's ``training`` (``sgd`` or ``adamw`` at ``training.lr``), as built-ins do."""
    lr_scheduler: SchedulerFactory | None = None
    """Optional ``lr_scheduler(optimizer)`` -> a scheduler, stepped once per optimizer step (once
    per global step in bsp and tokens); its state is checkpointed and handed to newcomers."""
    max_grad_norm: float | None = None
    """Clip the summed gradients to this global L2 norm before each step (None: no clipping)."""
    precision: str = "fp32"
    """``fp32``, or ``bf16``: forward and loss under ``torch.autocast`` in bfloat16 on CUDA workers
    (CPU workers run fp32)."""
    evaluate: Callable[[nn.Module, int], Mapping[str, float] | None] | None = None
    """``evaluate(model, step)``: called after every ``evaluate_every``-th step on one worker (rank
    0), the whole model in eval mode under ``torch.no_grad()``. The numbers it returns (name ->
    number, e.g. ``{"val_loss": 1.9}``) go into that step's metrics record (``eval``), ``felactl
    report``'s figures and ``--tensorboard``; it is also the place for the user's own logging
    (W&B, MLflow), which felactl does not depend on. The model is on the worker's device. For plans
    that keep the whole model on each worker (one stage, not sharded; refused at the start
    otherwise). The others wait for it at the next synchronisation, for the job's collective
    timeout at most (an elastic job's ``--collective-timeout``, 10 s by default): a longer
    evaluation fails their step, so keep it short or raise the timeout."""
    evaluate_every: int = 100
    split_points: Sequence[str] | None = None
    """Module paths where a pipeline stage may begin, in the order the forward runs them
    (``["model.layers.4", "model.layers.8"]``): the layers are then what runs before the first,
    and from each to the next. None: every block of the model's one block list, and the head
    after the last block on its own. ``[]``: never split (data parallel only)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise InputError(f"TrainJob.model: must be an nn.Module, got {type(self.model).__name__}")
        if isinstance(self.dataset, IterableDataset) or not (
            hasattr(self.dataset, "__getitem__") and hasattr(self.dataset, "__len__")
        ):
            raise InputError(
                "TrainJob.dataset: must be a map-style dataset (__getitem__ and __len__), "
                f"got {type(self.dataset).__name__}"
            )
        if len(self.dataset) < 1:
            raise InputError("TrainJob.dataset: is empty")
        for name in ("loss_fn", "collate_fn"):
            if not callable(getattr(self, name)):
                raise InputError(f"TrainJob.{name}: must be callable")
        for name in ("optimizer", "lr_scheduler"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise InputError(f"TrainJob.{name}: must be a factory (callable) or None")
        if self.evaluate is not None and not callable(self.evaluate):
            raise InputError("TrainJob.evaluate: must be callable (model, step) -> {name: number}, or None")
        every = self.evaluate_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InputError(f"TrainJob.evaluate_every: must be a whole number of steps >= 1, got {every!r}")
        norm = self.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0):
            raise InputError(f"TrainJob.max_grad_norm: must be a number > 0 or None, got {norm!r}")
        if self.precision not in PRECISIONS:
            raise InputError(f"TrainJob.precision: must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        self._check_split_points()

    def _check_split_points(self) -> None:
        points = self.split_points
        if points is None:
            return
        if isinstance(points, str) or not all(isinstance(p, str) for p in points):
            raise InputError(f"TrainJob.split_points: must be a list of module paths, got {points!r}")
        if isinstance(self.model, nn.Sequential) and points:
            raise InputError("TrainJob.split_points: an nn.Sequential is split between its children already")
        modules = dict(self.model.named_modules())
        for point in points:
            if point not in modules or not point:
                raise InputError(f"TrainJob.split_points: {point!r} is not a submodule of the model")
        if len(set(points)) != len(points):
            raise InputError(f"TrainJob.split_points: {points!r} names a module twice")

    def batch(self, indices: Sequence[int]) -> Sequence:
        """``(inputs, targets)`` of these global sample indices."""
        size = len(self.dataset)
        return self.collate_fn([self.dataset[int(i) % size] for i in indices])

    def autocast(self, device: torch.device):
        """The autocast context the forward and loss run in on ``device``."""
        enabled = self.precision == "bf16" and device.type == "cuda"
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


__all__ = ["PRECISIONS", "TrainJob"]
