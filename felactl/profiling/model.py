"""Per-layer cost profile of a real model: sizes, FLOPs and measured times -> a ``ModelSpec``.

The planner cuts the model between layers and gives each stage a micro-batch size, so it needs,
per layer: parameters (memory, gradient traffic), output bytes per sample (what crosses a stage
boundary), bytes kept for backward per sample (the memory of a micro-batch in flight), FLOPs per
sample (to scale to devices never profiled) and the forward and backward time at several
micro-batch sizes on this device. The times per sample shrink as the micro-batch grows until the
device saturates: that curve is what Fela's choice of micro-batch rests on.

FLOPs come from torch's own ``FlopCounterMode`` (with the CPU flash-attention kernels, which it
does not know, mapped to its attention formulas), never from hand formulas.

Every time is the median of blocks of ``repeats`` runs, repeated until the blocks agree
(``felactl.profiling.timing``); the spread is recorded with the timing, and the timings that never
settled are listed in the profile's ``noisy`` and named on stderr in one line.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils import flop_counter

from felactl.errors import InputError, ProfilingError
from felactl.machine import cpu_quota_cores
from felactl.models import ModelBundle, build
from felactl.profiling.devices import MIN_BLOCK_S, cpu_slot_model_name, matmul_tflops
from felactl.profiling.timing import MIN_BLOCKS, Timed, repeat_until_stable
from felactl.spec import Layer, LayerTiming, ModelSpec

log = logging.getLogger(__name__)
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 4, 16, 64)
DEFAULT_REPEATS = 5
"""Runs per block; a timing takes at least three blocks, more while they disagree."""
WARMUP_RUNS = 1
MAX_BLOCKS = 8
MAX_TIMING_S = 1.0
"""A timing stops adding blocks after this long (its minimum blocks always run)."""

DEVICE_REPETITIONS = 5
"""Timed blocks of the matmul behind ``timed_tflops`` (``felactl profile``'s default repetitions)."""


class Measured(NamedTuple):
    """A median time and how far its blocks disagreed (``Timed.spread``); ``noisy``: they never settled."""

    ms: float
    spread: float
    noisy: bool


class LayerTimes(NamedTuple):
    fwd_ms: float
    bwd_ms: float
    spread: float
    noisy: bool


Progress = Callable[[str, int, int], None]
"""``progress(phase, done, total)``, as the cluster profiler calls it: after each measured layer."""


Timer = Callable[[], float]


@dataclass(frozen=True)
class Clock:
    """How the runs of a timing are timed: wall seconds (``timer``), or, on a CPU slot a cgroup
    quota holds below its cores (``min_block_s`` > 0), CPU seconds stretched by the quota.

    Under a quota a run that fits in the quota's slice of a CFS period runs at the full core, and
    one that spans the slice's end waits out the period: the median of short runs read a tenth of a
    core as a full one (a layer of mlp at micro-batch 256 read 0.009 ms a sample there, the next
    0.19). So there every block of runs lasts at least ``min_block_s`` of wall time (0.1 s: a default CFS period, ten of a testbed's),
    each run is timed in the process's CPU seconds, and a block's runs are stretched by its wall
    time over its CPU seconds: what the quota makes of a CPU second, waits included."""

    timer: Timer = time.perf_counter
    min_block_s: float = 0.0

    @classmethod
    def for_device(cls, device: torch.device) -> Clock:
        """The quota's clock on a CPU slot whose quota (``felactl.machine.cpu_quota_cores``) is
        less than the threads torch computes with, so this process alone runs into it (a testbed
        node); the wall clock elsewhere, also under a quota this process cannot reach alone (a
        2-core container limit around one thread), where its median of runs keeps a preempted
        run's spike out as the quota's clock would not."""
        quota = cpu_quota_cores() if device.type == "cpu" else None
        if quota is not None and quota < torch.get_num_threads():
            return cls(timer=time.process_time, min_block_s=MIN_BLOCK_S)
        return cls()


WALL_CLOCK = Clock()


def this_device_model(device: str = "cpu") -> str:
    """The hardware model a profile is keyed by (``Device.model`` in a cluster spec).

    The same string the device profiler writes for this machine, so the planner can match a
    layer's timings to the devices that ran them.
    """
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        return torch.cuda.get_device_properties(torch_device).name
    return cpu_slot_model_name()


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _flop_mapping() -> dict[Any, Any]:
    """Attention on CPU runs kernels FlopCounterMode has no formula for; give it torch's own."""
    aten = torch.ops.aten
    mapping: dict[Any, Any] = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        mapping[aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_sdpa_flop
        mapping[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_sdpa_backward_flop
    return mapping


def count_flops(layer: nn.Module, inputs: torch.Tensor, *, input_grad: bool = True) -> tuple[int, int, torch.Tensor]:
    """Forward and backward FLOPs of ``layer`` on this batch, and its output (detached).

    ``input_grad=False`` for the first layer: its input is data, so backward computes only the
    weight gradients there.
    """
    inp = _leaf(inputs, input_grad)
    with flop_counter.FlopCounterMode(display=False, custom_mapping=_flop_mapping()) as counter:
        out = _forward(layer, inp)
    fwd_flops = counter.get_total_flops()
    bwd_flops = 0
    if out.requires_grad:
        with flop_counter.FlopCounterMode(display=False, custom_mapping=_flop_mapping()) as counter:
            out.backward(torch.ones_like(out))
        bwd_flops = counter.get_total_flops()
    _clear_grads(layer)
    return fwd_flops, bwd_flops, out.detach()


def saved_bytes(layer: nn.Module, inputs: torch.Tensor, *, input_grad: bool = True) -> int:
    """Bytes of the tensors autograd saves in ``layer``'s forward for its backward (weights
    excluded, each storage counted once): what a micro-batch in flight keeps in memory."""
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _forward(layer, _leaf(inputs, input_grad))
    return sum(saved.values())


def time_layer(
    layer: nn.Module,
    inputs: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    repeats: int,
    warmup: int = WARMUP_RUNS,
    input_grad: bool = True,
    clock: Clock = WALL_CLOCK,
) -> LayerTimes:
    """Median forward and backward milliseconds of ``layer`` on this micro-batch, over blocks of
    ``repeats`` runs repeated until they agree (see module doc).

    Backward is timed on its own: the layer's forward runs on a detached input that requires
    grad (as it would inside a stage), then autograd runs back from a fixed upstream gradient,
    computing the input and weight gradients a real step computes.
    """
    device = inputs.device
    timer = clock.timer

    def run() -> tuple[float, float]:
        inp = _leaf(inputs, input_grad)
        _clear_grads(layer)
        _synchronize(device)
        start = timer()
        out = _forward(layer, inp)
        _synchronize(device)
        mid = timer()
        if not out.requires_grad:
            return mid - start, 0.0
        out.backward(grad_out)
        _synchronize(device)
        return mid - start, timer() - mid

    runs, timed = _repeat_runs(run, repeats=repeats, warmup=warmup, clock=clock)
    _clear_grads(layer)
    return LayerTimes(
        statistics.median(f for f, _ in runs) * 1e3,
        statistics.median(b for _, b in runs) * 1e3,
        timed.spread,
        timed.noisy,
    )


def _repeat_runs(
    run: Callable[[], tuple[float, ...]], *, repeats: int, warmup: int, clock: Clock = WALL_CLOCK
) -> tuple[list[tuple[float, ...]], Timed]:
    """``warmup`` runs, then blocks of runs until the blocks' medians of each run's total agree
    or a cap is hit: every counted run's parts, and the blocks. The ``repeats`` runs are split
    over the fewest blocks a spread is read from, so a quiet machine pays about ``repeats`` runs,
    as a single median of them would (a profile of gpt-mini took 2 min with whole blocks of
    ``repeats`` on a busy machine); a busy one pays more blocks."""
    for _ in range(warmup):
        run()
    runs: list[tuple[float, ...]] = []
    per_block = max(1, -(-repeats // MIN_BLOCKS))

    def block() -> float:
        wall, cpu = time.perf_counter(), time.process_time()
        block_runs = [run() for _ in range(per_block)]
        while time.perf_counter() - wall < clock.min_block_s:
            block_runs.append(run())
        if clock.min_block_s > 0:  # CPU seconds, stretched as the quota stretched this block's
            cpu = time.process_time() - cpu
            stretch = (time.perf_counter() - wall) / cpu if cpu > 0 else 1.0
            block_runs = [tuple(part * stretch for part in parts) for parts in block_runs]
        runs.extend(block_runs)
        return statistics.median(sum(parts) for parts in block_runs)

    return runs, repeat_until_stable(block, max_blocks=MAX_BLOCKS, max_s=MAX_TIMING_S)


@dataclass
class _LayerStatic:
    """What a layer costs regardless of micro-batch size."""

    name: str
    kind: str
    params: int
    param_bytes: int
    activation_bytes_per_sample: int
    saved_bytes_per_sample: int
    fwd_flops_per_sample: float
    bwd_flops_per_sample: float


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
    batch_sizes = _check_batch_sizes(batch_sizes)
    if repeats < 1:
        raise InputError(f"repeats must be >= 1, got {repeats}")
    torch_device = _check_device(device)
    bundle = build(source, config or {}, seed=seed)
    layers = bundle.layers.to(torch_device)
    layers.train()
    spec_config = dict(bundle.config)
    if bundle.data is None:
        if input_shape is None:
            raise InputError(
                f"model {source!r} comes with no data: give the shape of one input sample (--input-shape, e.g. 3,32,32)"
            )
        spec_config["input_shape"] = [int(d) for d in input_shape]
    input_shape = spec_config.get("input_shape")
    input_grads = _input_grads(layers)
    statics = _profile_static(bundle, layers, batch_sizes[0], input_shape, input_grads, torch_device, seed)
    total = len(layers) * (len(batch_sizes) + 1)
    if progress is not None:
        progress("flops", len(layers), total)
    timings: list[list[LayerTiming]] = [[] for _ in layers]
    device_model = this_device_model(device)
    clock = Clock.for_device(torch_device)
    # The CPU's matmul rate is timed beside the layers, once before and once after each micro-batch
    # size's timings, and its median kept: a single timing moved +-13% between runs here (0.055 to
    # 0.071 TFLOP/s), and every device's predicted speed is scaled by it (CostModel.timed_slowdown).
    matmul_rates: list[float] = []

    def time_matmul() -> None:
        if matmul_size is not None and torch_device.type == "cpu":
            matmul_rates.append(matmul_tflops(matmul_size, DEVICE_REPETITIONS))

    time_matmul()
    scales: dict[str, float] = {}
    noisy: list[str] = []
    for b_index, batch in enumerate(batch_sizes):
        hidden = _example_input(bundle, batch, input_shape, torch_device, seed)
        for i, layer in enumerate(layers):
            try:
                out = _forward(layer, hidden).detach()
                times = time_layer(
                    layer,
                    hidden,
                    _fixed_gradient(out, seed + i),
                    repeats=repeats,
                    input_grad=input_grads[i],
                    clock=clock,
                )
            except torch.cuda.OutOfMemoryError:
                raise ProfilingError(
                    f"model {source!r}: layer {i} runs out of memory on {device} at "
                    f"micro-batch {batch}: profile smaller --batch-sizes"
                ) from None
            timings[i].append(
                LayerTiming(
                    device_model=device_model,
                    micro_batch=batch,
                    fwd_ms=times.fwd_ms,
                    bwd_ms=times.bwd_ms,
                    spread=round(times.spread, 3),
                )
            )
            _note_noisy(noisy, f"layers[{i}].timings[{b_index}]", times)
            hidden = out
            if progress is not None:
                progress(f"micro-batch {batch}, layer {i}", len(layers) * (b_index + 1) + i + 1, total)
        whole = _scale_to_whole_model(bundle, layers, timings, torch_device, repeats, clock)
        if whole is not None:
            scales[str(batch)] = whole.ms
            _note_noisy(noisy, f"whole_model_scale[{batch}]", whole)
        time_matmul()
    timed_tflops = {device_model: float(f"{statistics.median(matmul_rates):.4g}")} if matmul_rates else {}
    first_input = _example_input(bundle, 1, input_shape, torch_device, seed)
    step = time_optimizer_step(
        layers,
        repeats=repeats,
        seed=seed,
        backward=_training_backward(bundle, layers, batch_sizes, torch_device),
        clock=clock,
    )
    _note_noisy(noisy, "optimizer_step_ms", step)
    if noisy:
        log.warning(
            "warning: %s: %d timing(s) did not settle, the machine is too busy to trust them: %s",
            source,
            len(noisy),
            "; ".join(noisy),
        )
    return ModelSpec(
        name=bundle.name,
        source=source,
        config=spec_config,
        input_bytes_per_sample=_tensor_bytes(first_input),
        layers=tuple(Layer(timings=tuple(t), **vars(s)) for s, t in zip(statics, timings)),
        splittable=bundle.splittable,
        optimizer_step_ms=step.ms,
        whole_model_scale=scales,
        noisy=tuple(noisy),
        timed_tflops=timed_tflops,
    )


def _note_noisy(noisy: list[str], key: str, measured: Measured | LayerTimes) -> None:
    if measured.noisy:
        noisy.append(f"{key}: spread {measured.spread:.2f}")


def time_whole_model(
    bundle: ModelBundle,
    layers: nn.Sequential,
    batch: int,
    *,
    repeats: int,
    warmup: int = WARMUP_RUNS,
    clock: Clock = WALL_CLOCK,
) -> Measured:
    """Median milliseconds of one micro-batch through the whole model as a worker runs it: the
    job's ``batch`` of fresh indices (its dataset's samples and collate), to the device, forward,
    loss, backward and the loss read back (blocks of ``repeats`` runs until they agree).

    The per-layer timings miss the loss, the glue between layers and the cache effects of one long
    graph (together ~15% on gpt-mini), and the input: mlp's ``batch`` of 256 samples takes 2 ms
    beside its 28 ms of layers, which the plans on the testbeds measured as missing."""
    device = next((p.device for p in layers.parameters()), torch.device("cpu"))
    starts = itertools.count(0, batch)  # fresh samples each run, as a worker's next micro-batch

    def run() -> tuple[float]:
        _clear_grads(layers)
        _synchronize(device)
        start = clock.timer()
        start_index = next(starts)
        inputs, targets = bundle.data.batch(range(start_index, start_index + batch))
        loss = bundle.loss(layers(inputs.to(device)), targets.to(device))
        loss.backward()
        loss.item()
        _synchronize(device)
        return (clock.timer() - start,)

    runs, timed = _repeat_runs(run, repeats=repeats, warmup=warmup, clock=clock)
    _clear_grads(layers)
    return Measured(statistics.median(r for (r,) in runs) * 1e3, timed.spread, timed.noisy)


def _scale_to_whole_model(
    bundle: ModelBundle,
    layers: nn.Sequential,
    timings: list[list[LayerTiming]],
    device: torch.device,
    repeats: int,
    clock: Clock = WALL_CLOCK,
) -> Measured | None:
    """Scale the last timing of every layer (one micro-batch) by (whole model) / (sum of the
    layers), timed right after the layers so both see the same machine, so a stage of all layers
    costs what the whole model measured; return the factor (as ``ms``) and the whole model's
    spread. None (nothing scaled) for models without data: no targets for a loss."""
    row = [t[-1] for t in timings]
    layers_ms = sum(t.fwd_ms + t.bwd_ms for t in row)
    if bundle.data is None or layers_ms <= 0:
        return None
    batch = row[0].micro_batch
    try:
        whole = time_whole_model(bundle, layers, batch, repeats=repeats, clock=clock)
    except torch.cuda.OutOfMemoryError:
        raise ProfilingError(
            f"model {bundle.source!r}: the whole model runs out of memory on {device} "
            f"at micro-batch {batch}: profile smaller --batch-sizes"
        ) from None
    scale = whole.ms / layers_ms
    for layer_timings in timings:
        t = layer_timings[-1]
        layer_timings[-1] = replace(t, fwd_ms=t.fwd_ms * scale, bwd_ms=t.bwd_ms * scale)
    return whole._replace(ms=scale)


def time_optimizer_step(
    layers: nn.Module,
    *,
    repeats: int,
    seed: int = 0,
    warmup: int = WARMUP_RUNS,
    backward: Callable[[], None] | None = None,
    clock: Clock = WALL_CLOCK,
) -> Measured:
    """Median milliseconds of one AdamW ``step()`` and ``zero_grad()`` over ``layers``' trainable
    parameters, as a worker's ``optimizer_step`` runs them. With ``backward`` (a forward and
    backward of the model), each timed step follows one, as in training: its activations have
    pushed the weights and moments out of cache, which made the step ~1.5x slower than timed cold
    on gpt-mini here. Without it, seeded gradients. It updates the weights: call it last."""
    params = [p for p in layers.parameters() if p.requires_grad]
    if not params:
        return Measured(0.0, 0.0, False)
    gen = torch.Generator().manual_seed(seed)

    def seeded_gradients() -> None:
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device)

    prepare = backward or seeded_gradients
    optimizer = torch.optim.AdamW(params, lr=1e-6)

    def run() -> tuple[float]:
        prepare()
        _synchronize(params[0].device)
        start = clock.timer()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _synchronize(params[0].device)
        return (clock.timer() - start,)

    runs, timed = _repeat_runs(run, repeats=repeats, warmup=warmup, clock=clock)
    _clear_grads(layers)
    return Measured(statistics.median(r for (r,) in runs) * 1e3, timed.spread, timed.noisy)


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
    inputs, targets = inputs.to(device), targets.to(device)
    return lambda: bundle.loss(layers(inputs), targets).backward()


def _input_grads(layers: nn.Sequential) -> list[bool]:
    """Whether each layer's backward must produce its input's gradient: only if a trainable
    layer comes before it (before the first one, everything is data)."""
    needed, seen_params = [], False
    for layer in layers:
        needed.append(seen_params)
        seen_params = seen_params or any(p.requires_grad for p in layer.parameters())
    return needed


def _profile_static(
    bundle: ModelBundle,
    layers: nn.Sequential,
    batch: int,
    input_shape: Sequence[int] | None,
    input_grads: list[bool],
    device: torch.device,
    seed: int,
) -> list[_LayerStatic]:
    hidden = _example_input(bundle, batch, input_shape, device, seed)
    statics = []
    for i, (child_name, layer) in enumerate(layers.named_children()):
        try:
            fwd_flops, bwd_flops, out = count_flops(layer, hidden, input_grad=input_grads[i])
            saved = saved_bytes(layer, hidden, input_grad=input_grads[i])
        except InputError as exc:
            raise InputError(f"model {bundle.source!r}: layer {i}: {exc}") from None
        trainable = [p for p in layer.parameters() if p.requires_grad]
        kind = _kind(layer)
        statics.append(
            _LayerStatic(
                name=child_name if not child_name.isdigit() else f"{i}.{kind}",
                kind=kind,
                params=sum(p.numel() for p in trainable),
                param_bytes=sum(p.numel() * p.element_size() for p in trainable),
                activation_bytes_per_sample=max(1, _tensor_bytes(out) // batch),
                saved_bytes_per_sample=saved // batch,
                fwd_flops_per_sample=fwd_flops / batch,
                bwd_flops_per_sample=bwd_flops / batch,
            )
        )
        hidden = out
    return statics


def _kind(layer: nn.Module) -> str:
    """Class name; for a plain ``nn.Sequential`` the names of its parts (``Conv2d+ReLU``)."""
    if type(layer) is nn.Sequential:
        return "+".join(type(part).__name__ for part in layer)
    return type(layer).__name__


def _example_input(
    bundle: ModelBundle, batch: int, input_shape: Sequence[int] | None, device: torch.device, seed: int
) -> torch.Tensor:
    if bundle.data is not None:
        inputs, _targets = bundle.data.batch(range(batch))
    else:
        gen = torch.Generator().manual_seed(seed)
        inputs = torch.randn((batch, *input_shape), generator=gen)
    return inputs.to(device)


def _forward(layer: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    try:
        out = layer(inputs)
    except Exception as exc:
        raise InputError(
            f"{_kind(layer)} failed on an input of shape {tuple(inputs.shape)}: "
            f"{type(exc).__name__}: {exc}".splitlines()[0]
        ) from None
    if not isinstance(out, torch.Tensor):
        raise InputError(
            f"layer {_kind(layer)} returned {type(out).__name__}, expected one tensor "
            f"(each layer of a felactl model maps a tensor to a tensor)"
        )
    return out


def _leaf(inputs: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """The layer input cut from any graph; it requires grad as a layer's input does mid-model."""
    leaf = inputs.detach()
    if requires_grad and leaf.is_floating_point():
        leaf.requires_grad_(True)
    return leaf


def _fixed_gradient(out: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)


def _clear_grads(layer: nn.Module) -> None:
    for p in layer.parameters():
        p.grad = None


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


__all__ = [
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_REPEATS",
    "LayerTimes",
    "Clock",
    "Measured",
    "count_flops",
    "middle_batch",
    "profile_model",
    "saved_bytes",
    "this_device_model",
    "time_layer",
    "time_optimizer_step",
    "time_whole_model",
]
