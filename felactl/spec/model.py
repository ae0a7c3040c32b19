"""The Model format: the ordered layers of a model with their sizes, FLOPs and measured times."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from felactl import limits
from felactl.spec.codec import SCHEMA_VERSION, FieldProblem, check_header, positive


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerTiming:
    device_model: str
    """The ``Device.model`` these times were measured on."""
    micro_batch: int
    fwd_ms: float
    """Forward time of the layer on one micro-batch of this size, median of repetitions."""
    bwd_ms: float
    """Backward time (input and weight gradients) on one micro-batch of this size."""
    spread: float | None = None
    """Optional: how far the blocks of repetitions the times are the median of disagreed, as the
    interquartile range of the blocks' forward + backward over its median (0.1: 10%). Timings
    whose spread stayed above the profiler's limit are listed in ``ModelSpec.noisy``."""

    def __post_init__(self) -> None:
        positive("micro_batch", self.micro_batch, limits.BATCH)
        positive("fwd_ms", self.fwd_ms, limits.MILLISECONDS, allow_zero=True)
        positive("bwd_ms", self.bwd_ms, limits.MILLISECONDS, allow_zero=True)
        if self.spread is not None:
            positive("spread", self.spread, allow_zero=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class TiedWeight:
    """A weight several layers read (a head tied to the embedding)."""

    layers: tuple[int, ...]
    """The layers that read it, by index."""
    params: int
    """Its parameters: counted in each of those layers' ``params`` (each stage holding one of them
    holds a copy), once in the model's."""

    def __post_init__(self) -> None:
        positive("params", self.params, limits.PARAMS)


@dataclass(frozen=True, kw_only=True, slots=True)
class Layer:
    name: str
    params: int
    """Number of trainable parameters."""
    param_bytes: int
    activation_bytes_per_sample: int
    """Bytes of this layer's output for one sample: what crosses a stage boundary after it."""
    saved_bytes_per_sample: int | None = None
    """Bytes autograd keeps from this layer's forward until its backward, per sample (its input and
    intermediates, not its weights): the memory one micro-batch in flight holds."""
    fwd_flops_per_sample: float
    bwd_flops_per_sample: float
    timings: tuple[LayerTiming, ...] = ()
    kind: str | None = None
    """The module's class name, for people reading the file (``Linear``, ``Conv2d``, ``Block``)."""

    def __post_init__(self) -> None:
        if not self.name:
            raise FieldProblem("name", "must not be empty")
        positive("params", self.params, limits.PARAMS, allow_zero=True)
        positive("param_bytes", self.param_bytes, limits.BYTES, allow_zero=True)
        positive("activation_bytes_per_sample", self.activation_bytes_per_sample, limits.BYTES)
        if self.saved_bytes_per_sample is not None:
            positive("saved_bytes_per_sample", self.saved_bytes_per_sample, limits.BYTES, allow_zero=True)
        positive("fwd_flops_per_sample", self.fwd_flops_per_sample, limits.FLOPS, allow_zero=True)
        positive("bwd_flops_per_sample", self.bwd_flops_per_sample, limits.FLOPS, allow_zero=True)
        seen = set()
        for i, t in enumerate(self.timings):
            key = (t.device_model, t.micro_batch)
            if key in seen:
                raise FieldProblem(
                    f"timings[{i}]", f"duplicate timing for {t.device_model!r} at micro_batch {t.micro_batch}"
                )
            seen.add(key)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncTiming:
    """What gradient sync adds to a data-parallel step of the whole model on a group of devices,
    measured as training runs it (``felactl.profiling.data_parallel``)."""

    cluster: str
    """The cluster profile the devices belong to (its ``name``): the cost model applies the timing
    only to a cluster of that name, so a model profile taken elsewhere does not mislead a plan."""
    devices: tuple[str, ...]
    """The group, by device name: one process per device, all in one process group."""
    backend: str
    micro_batch: int
    """Samples per device in the measured step."""
    sync_ms: float | None = None
    """Step with DDP's gradient allreduce minus step without it (``no_sync``): the median over pairs
    of adjacent blocks of the difference of their medians. Absent where that difference was not
    above its noise (``noise_ms``): sync then was not measured, and is never taken as 0. (Profiles
    written before ``noise_ms`` existed may hold 0 here; the cost model reads that as absent.)"""
    noise_ms: float | None = None
    """Optional: the noise of ``sync_ms``, the pairs' interquartile range over sqrt(pairs). Where
    ``sync_ms`` is absent, sync was not told apart from this much noise."""
    noisy: bool = False
    """True where the profiler's cap on pairs of blocks was hit with the noise still large next to
    the step: the machine was too busy to trust ``sync_ms``."""

    def __post_init__(self) -> None:
        if len(self.devices) < 2 or len(set(self.devices)) != len(self.devices):
            raise FieldProblem("devices", "a sync timing needs two or more distinct devices")
        positive("micro_batch", self.micro_batch, limits.BATCH)
        if self.sync_ms is not None:
            positive("sync_ms", self.sync_ms, limits.MILLISECONDS, allow_zero=True)
        if self.noise_ms is not None:
            positive("noise_ms", self.noise_ms, limits.MILLISECONDS, allow_zero=True)

    @property
    def measured(self) -> bool:
        """Whether the profile told a sync time apart from its noise (a 0 of an old file: no)."""
        return self.sync_ms is not None and self.sync_ms > 0


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    kind: str = "Model"
    schema_version: int = SCHEMA_VERSION
    name: str
    source: str
    """How to build it: a built-in name (``gpt-mini``) or ``package.module:function``."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments the source was built with (depth, width, ...)."""
    input_bytes_per_sample: int
    """Bytes of one input sample as fed to the first layer."""
    layers: tuple[Layer, ...]
    splittable: bool = True
    """Whether a plan may cut the layers into stages: the model is an ``nn.Sequential`` whose
    children are the layers, or a model cut at its blocks (:mod:`felactl.models.split`). False
    (any other module, profiled as one layer): data-parallel plans only. Absent in profiles
    written before it: True."""
    optimizer_step_ms: float | None = None
    """Optional: one AdamW ``optimizer.step()`` over all the model's parameters, measured on the
    device the timings came from; the cost model charges each stage its share by parameters."""
    optimizer_step_ms_by_device_model: dict[str, float] = field(default_factory=dict)
    """Optional, for a profile whose timings are of several device models (``felactl profile
    --model --testbed`` times the model in every node): each model's optimizer step, as
    ``optimizer_step_ms`` is the one device model's."""
    whole_model_scale: dict[str, float] = field(default_factory=dict)
    """Optional record, per micro-batch (as a string): the whole model's forward + loss + backward
    time divided by its layers' and its loss's timed in sequence (each layer's timing at that
    micro-batch is its time in sequence, times this)."""
    loss_ms: dict[str, float] = field(default_factory=dict)
    """Optional record, per micro-batch (as a string): the loss's forward + backward milliseconds,
    timed after the layers in sequence and scaled as they are, which the last layer's timing
    includes (where a pipeline's last stage computes it). Absent in profiles written before it:
    there the loss was spread over every layer by ``whole_model_scale``."""
    data_parallel_sync: tuple[SyncTiming, ...] = ()
    timed_tflops: dict[str, float] = field(default_factory=dict)
    """Optional, per device model the timings are of: the dense matmul TFLOP/s of the device they
    were taken on, measured as ``felactl profile`` measures a cluster's devices (the same matmul
    side). A device of that model whose cluster profile measured another speed (a CPU share under
    a cgroup, a throttled GPU) takes the timings scaled by timed / its own TFLOP/s."""
    """Optional: measured gradient sync of the whole model on groups of devices; the cost model
    scales its link-based estimate of any group inside a measured one by measured / estimate."""
    tied: tuple[TiedWeight, ...] = ()
    """Weights that several layers read (a head tied to the embedding: the first and the last
    layer). Stages that hold such layers each hold a copy, their gradients summed: a plan keeps
    those layers on devices of one kind, so the copies step alike."""
    noisy: tuple[str, ...] = ()
    """The timings of this profile whose repetitions still disagreed when the profiler's cap on
    them was hit, by key path with their spread (``layers[2].timings[0]: spread 0.31``;
    ``layers[*].timings[0]`` where every layer was timed in one pass, as a ``TrainJob``'s are): the
    machine was too busy to trust them. Empty: every timing settled (or an older profile)."""

    def __post_init__(self) -> None:
        check_header(self.kind, "Model", self.schema_version)
        if self.optimizer_step_ms is not None:
            positive("optimizer_step_ms", self.optimizer_step_ms, limits.MILLISECONDS, allow_zero=True)
        if not self.source:
            raise FieldProblem("source", "must not be empty")
        positive("input_bytes_per_sample", self.input_bytes_per_sample, limits.BYTES)
        if not self.layers:
            raise FieldProblem("layers", "a model needs at least one layer")
        if not any(layer.fwd_flops_per_sample or layer.bwd_flops_per_sample for layer in self.layers):
            raise FieldProblem("layers", "every layer has 0 FLOPs per sample: nothing to price a device by")
        for batch, ms in self.loss_ms.items():
            positive(f"loss_ms[{batch!r}]", ms, limits.MILLISECONDS, allow_zero=True)
        for device_model, tflops in self.timed_tflops.items():
            positive(f"timed_tflops[{device_model!r}]", tflops, limits.TFLOPS)
        for device_model, ms in self.optimizer_step_ms_by_device_model.items():
            positive(f"optimizer_step_ms_by_device_model[{device_model!r}]", ms, limits.MILLISECONDS, allow_zero=True)
        groups = set()
        for i, timing in enumerate(self.data_parallel_sync):
            group = (timing.cluster, frozenset(timing.devices))
            if group in groups:
                raise FieldProblem(f"data_parallel_sync[{i}]", "a second timing for the same cluster and devices")
            groups.add(group)
        for g, tied in enumerate(self.tied):
            if len(tied.layers) < 2 or any(not 0 <= i < len(self.layers) for i in tied.layers):
                raise FieldProblem(
                    f"tied[{g}].layers",
                    f"must name two or more of the {len(self.layers)} layers, got {list(tied.layers)}",
                )
        names = set()
        for i, layer in enumerate(self.layers):
            if layer.name in names:
                raise FieldProblem(f"layers[{i}].name", f"duplicate layer name {layer.name!r}")
            names.add(layer.name)

    def untrusted(self) -> list[str]:
        """What of this profile the machine was too busy to measure: ``noisy``, each noisy sync
        timing and each sync not told apart from its noise, one phrase each."""
        found = list(self.noisy)
        for i, timing in enumerate(self.data_parallel_sync):
            noise = "" if timing.noise_ms is None else f" (noise {timing.noise_ms:g} ms)"
            if not timing.measured:
                found.append(f"data_parallel_sync[{i}]: sync not told apart from its noise{noise}")
            elif timing.noisy:
                found.append(f"data_parallel_sync[{i}]: sync {timing.sync_ms:g} ms, noisy{noise}")
        return found

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def timed_device_models(self) -> set[str]:
        """The device models the layers' timings are of."""
        return {t.device_model for layer in self.layers for t in layer.timings}

    def optimizer_step_ms_of(self, device_model: str) -> float | None:
        """The optimizer step on ``device_model``: its own entry, else ``optimizer_step_ms`` where
        the layers were timed on that model; None where neither was measured."""
        if device_model in self.optimizer_step_ms_by_device_model:
            return self.optimizer_step_ms_by_device_model[device_model]
        return self.optimizer_step_ms if device_model in self.timed_device_models else None

    @property
    def total_params(self) -> int:
        """The model's parameters, a tied weight once (the layers' ``params`` count it in each)."""
        return sum(layer.params for layer in self.layers) - sum(t.params * (len(t.layers) - 1) for t in self.tied)
