"""Per-layer cost profile of a real model: sizes, FLOPs and measured times -> a ``ModelSpec``.

The planner cuts the model between layers and gives each stage a micro-batch size, so it needs,
per layer: parameters (memory, gradient traffic), output bytes per sample (what crosses a stage
boundary), bytes kept for backward per sample (the memory of a micro-batch in flight), FLOPs per
sample (to scale to devices never profiled) and the forward and backward time at several
micro-batch sizes on this device. The times per sample shrink as the micro-batch grows until the
device saturates: that curve is what Fela's choice of micro-batch rests on.

See :mod:`~felactl.profiling.layers` for the sizes and FLOPs and
:mod:`~felactl.profiling.model_timing` for the times; this module runs both over a model and
assembles the ``ModelSpec``.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from felactl.errors import InputError, ProfilingError
from felactl.models import ModelBundle, build, values
from felactl.profiling.devices import cpu_slot_model_name, matmul_tflops
from felactl.profiling.layers import example_input, forward, input_grads_needed, profile_static, tensor_bytes
from felactl.profiling.model_timing import (
    DEFAULT_REPEATS,
    Clock,
    LayerTimes,
    Measured,
    WholeModel,
    fixed_gradient,
    time_as_a_step,
    time_layer,
    time_optimizer_step,
)
from felactl.spec import Layer, LayerTiming, ModelSpec

log = logging.getLogger(__name__)
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 4, 16, 64)

DEVICE_REPETITIONS = 5
"""Timed blocks of the matmul behind ``timed_tflops`` (``felactl profile``'s default repetitions)."""


Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``, as the cluster profiler calls it: after each measured layer."""


def this_device_model(device: str = "cpu") -> str:
    """The hardware model a profile is keyed by (``Device.model`` in a cluster spec).

    The same string the device profiler writes for this machine, so the planner can match a
    layer's timings to the devices that ran them.
    """
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        return torch.cuda.get_device_properties(torch_device).name
    return cpu_slot_model_name()


def profile_model(
    source: str,
    config: dict[str, Any] | None = None,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    *,
    device: str = "cpu",
    repeats: int = DEFAULT_REPEATS,
    input_shape: Sequence[int] | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    matmul_size: int | None = None,
) -> ModelSpec:
    """Profile every layer of model ``source`` (built-in name or ``package.module:function``).

    ``matmul_size`` (CPU only): also time this process's matmul as ``felactl profile`` times a CPU
    slot (:func:`~felactl.profiling.devices.matmul_tflops`, the same side) and record it as
    ``timed_tflops``, so the planner scales the timings to slots of this CPU at other speeds.

    ``input_shape`` (one sample, without the batch axis) is needed only for user models that
    return no data; their inputs are then seeded standard-normal tensors.
    """
    batch_sizes, torch_device = _check_settings(batch_sizes, repeats, device)
    bundle, layers, spec_config = _load(source, config, seed, torch_device, input_shape)
    input_shape = spec_config.get("input_shape")
    input_grads, clock = input_grads_needed(layers), Clock.for_device(torch_device)
    statics = profile_static(bundle, layers, batch_sizes[0], input_shape, input_grads, torch_device, seed)
    timed = _time_micro_batches(
        source,
        bundle,
        layers,
        batch_sizes,
        device=device,
        torch_device=torch_device,
        input_shape=input_shape,
        input_grads=input_grads,
        repeats=repeats,
        seed=seed,
        clock=clock,
        progress=progress,
        matmul_size=matmul_size,
    )
    backward = _training_backward(bundle, layers, batch_sizes, torch_device)
    step = time_optimizer_step(layers, repeats=repeats, seed=seed, backward=backward, clock=clock)
    noisy = timed.noisy
    _note_noisy(noisy, "optimizer_step_ms", step)
    _warn_noisy(source, noisy)
    return ModelSpec(
        name=bundle.name,
        source=source,
        config=spec_config,
        input_bytes_per_sample=tensor_bytes(example_input(bundle, 1, input_shape, torch_device, seed)),
        layers=tuple(Layer(timings=tuple(t), **vars(s)) for s, t in zip(statics, timed.timings)),
        splittable=bundle.splittable,
        tied=bundle.tied_weights(),
        optimizer_step_ms=step.ms,
        whole_model_scale=timed.whole_model_scale,
        loss_ms=timed.loss_ms,
        noisy=tuple(noisy),
        timed_tflops=timed.timed_tflops,
    )


class _MicroBatchTimings(NamedTuple):
    """Each layer's timings at every micro-batch size; per micro-batch size (as a string) the whole
    model's scale and the loss's own milliseconds; this CPU's matmul rate; the unsettled timings."""

    timings: list[list[LayerTiming]]
    whole_model_scale: dict[str, float]
    loss_ms: dict[str, float]
    timed_tflops: dict[str, float]
    noisy: list[str]


def _time_micro_batches(
    source: str,
    bundle: ModelBundle,
    layers: nn.Sequential,
    batch_sizes: Sequence[int],
    *,
    device: str,
    torch_device: torch.device,
    input_shape: Sequence[int] | None,
    input_grads: list[bool],
    repeats: int,
    seed: int,
    clock: Clock,
    progress: Progress | None,
    matmul_size: int | None,
) -> _MicroBatchTimings:
    """The layers timed at every micro-batch size, each size's whole model and loss, and this
    CPU's matmul rate (with ``matmul_size``)."""
    total = len(layers) * (len(batch_sizes) + 1)
    if progress is not None:
        progress("flops", len(layers), total)
    timings: list[list[LayerTiming]] = [[] for _ in layers]
    device_model = this_device_model(device)
    # The CPU's matmul rate is timed beside the layers, once before and once after each micro-batch
    # size's timings, and its median kept: a single timing moved +-13% between runs here (0.055 to
    # 0.071 TFLOP/s), and every device's predicted speed is scaled by it (CostModel.timed_slowdown).
    matmul_rates: list[float] = []

    def time_matmul() -> None:
        if matmul_size is not None and torch_device.type == "cpu":
            matmul_rates.append(matmul_tflops(matmul_size, DEVICE_REPETITIONS))

    time_matmul()
    scales: dict[str, float] = {}
    loss_ms: dict[str, float] = {}
    noisy: list[str] = []
    for b_index, batch in enumerate(batch_sizes):
        if bundle.data is None:  # no data, no step to time the layers in: each alone
            hidden = example_input(bundle, batch, input_shape, torch_device, seed)
            for i, layer in enumerate(layers):
                where = f"model {source!r}: layer {i} runs out of memory on {device} at micro-batch {batch}"
                times, hidden = _time_one_layer(layer, hidden, where, seed + i, repeats, input_grads[i], clock)
                timings[i].append(times.timing(device_model, batch))
                _note_noisy(noisy, f"layers[{i}].timings[{b_index}]", times)
                if progress is not None:
                    progress(f"micro-batch {batch}, layer {i}", len(layers) * (b_index + 1) + i + 1, total)
        else:  # timed as a step runs them, which is what a stage pays
            row, whole = time_as_a_step(bundle, layers, batch, input_grads, device_model, repeats=repeats, clock=clock)
            for layer_timings, timing in zip(timings, row):
                layer_timings.append(timing)
            scales[str(batch)], loss_ms[str(batch)] = whole.scale, whole.loss_ms
            _note_noisy(noisy, f"layers[*].timings[{b_index}]", whole)  # every layer, timed in one pass
            if progress is not None:
                for i in range(len(layers)):
                    progress(f"micro-batch {batch}, layer {i}", len(layers) * (b_index + 1) + i + 1, total)
        time_matmul()
    timed_tflops = {device_model: float(f"{statistics.median(matmul_rates):.4g}")} if matmul_rates else {}
    return _MicroBatchTimings(timings, scales, loss_ms, timed_tflops, noisy)


def _load(
    source: str, config: dict[str, Any] | None, seed: int, device: torch.device, input_shape: Sequence[int] | None
) -> tuple[ModelBundle, nn.Sequential, dict[str, Any]]:
    """Model ``source`` built and on ``device`` in training mode, with the config its profile
    records (the ``input_shape`` a model without data was given, with it)."""
    bundle = build(source, config or {}, seed=seed)
    layers = bundle.layers.to(device)
    layers.train()
    spec_config = dict(bundle.config)
    if bundle.data is not None and input_shape is not None:
        raise InputError(
            f"--input-shape is for a model that comes without data; {source!r} returns a TrainJob, "
            "whose dataset gives the inputs: leave it out"
        )
    if bundle.data is None:
        if input_shape is None:
            raise InputError(
                f"model {source!r} comes with no data: give the shape of one input sample (--input-shape, e.g. 3,32,32)"
            )
        spec_config["input_shape"] = [int(d) for d in input_shape]
    return bundle, layers, spec_config


def _time_one_layer(
    layer: nn.Module, hidden: torch.Tensor, where: str, seed: int, repeats: int, input_grad: bool, clock: Clock
) -> tuple[LayerTimes, torch.Tensor]:
    """``layer``'s times on its input ``hidden``, and its output (the next layer's input); running
    out of memory is a :class:`ProfilingError` that says ``where``."""
    try:
        out = values.cut_from_graph(forward(layer, hidden), False)
        times = time_layer(
            layer, hidden, fixed_gradient(out, seed), repeats=repeats, input_grad=input_grad, clock=clock
        )
    except torch.cuda.OutOfMemoryError:
        raise ProfilingError(f"{where}: profile smaller --batch-sizes") from None
    return times, out


def _warn_noisy(source: str, noisy: list[str]) -> None:
    if noisy:
        log.warning(
            "warning: %s: %d timing(s) did not settle, the machine is too busy to trust them: %s",
            source,
            len(noisy),
            "; ".join(noisy),
        )


def _note_noisy(noisy: list[str], key: str, measured: Measured | LayerTimes | WholeModel) -> None:
    if measured.noisy:
        noisy.append(f"{key}: spread {measured.spread:.2f}")


def middle_batch(batch_sizes: Sequence[int]) -> int:
    """The middle of the profiled micro-batch sizes: a typical training step's, where one is needed."""
    return sorted(batch_sizes)[len(batch_sizes) // 2]


def _training_backward(
    bundle: ModelBundle, layers: nn.Sequential, batch_sizes: Sequence[int], device: torch.device
) -> Callable[[], None] | None:
    """A forward, loss and backward of the whole model on a middle profiled micro-batch, for
    timing the optimizer step as it follows one in training; None for models without data."""
    if bundle.data is None:
        return None
    inputs, targets = bundle.data.batch(range(middle_batch(batch_sizes)))
    inputs, targets = values.to_device(inputs, device), values.to_device(targets, device)
    return lambda: bundle.loss(layers(inputs), targets).backward()


def _check_settings(batch_sizes: Sequence[int], repeats: int, device: str) -> tuple[list[int], torch.device]:
    """The micro-batch sizes, sorted and distinct, and the device to profile on; bad ones refused."""
    batch_sizes = _check_batch_sizes(batch_sizes)
    if repeats < 1:
        raise InputError(f"repeats must be >= 1, got {repeats}")
    return batch_sizes, _check_device(device)


def _check_batch_sizes(batch_sizes: Sequence[int]) -> list[int]:
    sizes = sorted(set(int(b) for b in batch_sizes))
    if not sizes:
        raise InputError("give at least one micro-batch size")
    if sizes[0] < 1:
        raise InputError(f"micro-batch sizes must be >= 1, got {sizes[0]}")
    return sizes


def _check_device(device: str) -> torch.device:
    try:
        torch_device = torch.device(device)
    except RuntimeError as exc:
        raise InputError(f"device {device!r}: {exc}") from None
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device!r}: CUDA is not available on this machine")
    if torch_device.type not in ("cpu", "cuda"):
        raise InputError(f"device {device!r}: only cpu and cuda can be profiled")
    return torch_device


__all__ = ["DEFAULT_BATCH_SIZES", "middle_batch", "profile_model", "this_device_model"]
