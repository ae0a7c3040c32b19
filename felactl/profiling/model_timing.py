"""Timing a model as a worker runs it: one layer's forward and backward, every layer's and the
loss's in sequence as a step runs them, the whole model's micro-batch, the optimizer step, each
on the clock that fits the device (wall seconds, or a CPU quota's).

Every time is the median of blocks of ``repeats`` runs, repeated until the blocks agree
(``felactl.profiling.timing``); the spread is recorded with the timing, and the timings that never
settled are listed in the profile's ``noisy`` and named on stderr in one line.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from felactl.errors import ProfilingError
from felactl.machine import cpu_quota_cores
from felactl.models import ModelBundle, values
from felactl.profiling.devices import MIN_BLOCK_S
from felactl.profiling.layers import clear_grads, forward, leaf
from felactl.profiling.timing import MIN_BLOCKS, Timed, repeat_until_stable
from felactl.spec import LayerTiming

DEFAULT_REPEATS = 5
"""Runs per block; a timing takes at least three blocks, more while they disagree."""
WARMUP_RUNS = 1
MAX_BLOCKS = 8
MAX_TIMING_S = 1.0
"""A timing stops adding blocks after this long (its minimum blocks always run)."""


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

    def timing(self, device_model: str, micro_batch: int) -> LayerTiming:
        """These times as a profile records them for ``device_model`` at ``micro_batch``."""
        return LayerTiming(
            device_model=device_model,
            micro_batch=micro_batch,
            fwd_ms=self.fwd_ms,
            bwd_ms=self.bwd_ms,
            spread=round(self.spread, 3),
        )


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


def time_layer(
    layer: nn.Module,
    inputs: Any,
    grad_out: list[torch.Tensor],
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
    device = values.tensors(inputs)[0].device
    timer = clock.timer

    def run() -> tuple[float, float]:
        inp = leaf(inputs, input_grad)
        clear_grads(layer)
        _synchronize(device)
        start = timer()
        out = forward(layer, inp)
        _synchronize(device)
        mid = timer()
        if not values.requires_grad(out):
            return mid - start, 0.0
        values.backward(out, grad_out)
        _synchronize(device)
        return mid - start, timer() - mid

    runs, timed = _repeat_runs(run, repeats=repeats, warmup=warmup, clock=clock)
    clear_grads(layer)
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
    device = _device_of(layers)
    starts = itertools.count(0, batch)  # fresh samples each run, as a worker's next micro-batch

    def run() -> tuple[float]:
        clear_grads(layers)
        _synchronize(device)
        start = clock.timer()
        start_index = next(starts)
        inputs, targets = bundle.data.batch(range(start_index, start_index + batch))
        loss = bundle.loss(layers(values.to_device(inputs, device)), values.to_device(targets, device))
        loss.backward()
        loss.item()
        _synchronize(device)
        return (clock.timer() - start,)

    runs, timed = _repeat_runs(run, repeats=repeats, warmup=warmup, clock=clock)
    clear_grads(layers)
    return Measured(statistics.median(r for (r,) in runs) * 1e3, timed.spread, timed.noisy)


class WholeModel(NamedTuple):
    """What :func:`time_as_a_step` found: the whole model's time over the layers' and the
    loss's in sequence, the loss's forward + backward milliseconds (on the last layer, scaled),
    and the larger spread of the two timings."""

    scale: float
    loss_ms: float
    spread: float
    noisy: bool


class InSequence(NamedTuple):
    """Medians of every layer's forward and backward milliseconds, and the loss's, timed in one
    pass through the model as a pipeline's stages run it (:func:`time_in_sequence`)."""

    fwd_ms: list[float]
    bwd_ms: list[float]
    loss_fwd_ms: float
    loss_bwd_ms: float
    spread: float
    noisy: bool


def time_in_sequence(
    bundle: ModelBundle,
    layers: nn.Sequential,
    batch: int,
    input_grads: list[bool],
    *,
    repeats: int,
    clock: Clock = WALL_CLOCK,
) -> InSequence:
    """Every layer's forward and backward, and the loss's, on the job's fresh micro-batches of
    ``batch``, timed in the order a training step runs them: each layer on its input cut from the
    layer before (as at a stage's boundary), the loss, then each layer's backward from the last.

    Timed alone, on one input again and again, a layer finds its weights, its input and its
    output's buffers in cache; in a step the layers before have pushed them out. A LLaMA-shaped
    LM's untied head over 4096 words took 1.9 ms alone and 2.5 in sequence, its loss 0.9 and 1.4
    (a 2 MB logits tensor), and a pipeline's last stage ran 1.44x its price
    (``benchmarks/bench_loss_stage.py``, BENCHMARKS.md)."""
    device = _device_of(layers)
    starts = itertools.count(0, batch)  # fresh samples each run, as a worker's next micro-batch
    timer = clock.timer

    def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
        _synchronize(device)
        start = timer()
        out = fn()
        _synchronize(device)
        return out, timer() - start

    def run() -> tuple[float, ...]:
        clear_grads(layers)
        first = next(starts)
        inputs, targets = bundle.data.batch(range(first, first + batch))
        x, targets = values.to_device(inputs, device), values.to_device(targets, device)
        cuts, outs, fwd = [], [], []
        for layer, input_grad in zip(layers, input_grads):
            cuts.append(leaf(x, input_grad))
            x, seconds = timed(lambda layer=layer: forward(layer, cuts[-1]))
            outs.append(x)
            fwd.append(seconds)
        output = leaf(x, True)
        loss, loss_fwd = timed(lambda: bundle.loss(output, targets))
        _, loss_bwd = timed(loss.backward)
        grads, bwd = values.input_grads(output), []
        for cut, out in zip(reversed(cuts), reversed(outs)):
            _, seconds = timed(lambda out=out, grads=grads: values.backward(out, grads))
            bwd.append(seconds)
            grads = values.input_grads(cut)
        return (*fwd, loss_fwd, loss_bwd, *reversed(bwd))

    runs, timed_runs = _repeat_runs(run, repeats=repeats, warmup=WARMUP_RUNS, clock=clock)
    clear_grads(layers)
    n = len(layers)
    ms = [statistics.median(r[i] for r in runs) * 1e3 for i in range(2 * n + 2)]
    return InSequence(ms[:n], ms[n + 2 :], ms[n], ms[n + 1], timed_runs.spread, timed_runs.noisy)


def time_as_a_step(
    bundle: ModelBundle,
    layers: nn.Sequential,
    batch: int,
    input_grads: list[bool],
    device_model: str,
    *,
    repeats: int,
    clock: Clock = WALL_CLOCK,
) -> tuple[list[LayerTiming], WholeModel]:
    """Every layer's timing at micro-batch ``batch`` as a step pays it: timed in sequence on fresh
    micro-batches (:func:`time_in_sequence`), the loss on the last layer, where a pipeline's last
    stage computes it; then all scaled by the whole model's forward + loss + backward (one graph,
    timed right after) over their sum, so that a stage of all layers costs what the whole model
    measured. For a model with data (a ``TrainJob``): one without has no targets for a loss, and
    its layers are timed alone (:func:`time_layer`)."""
    device = _device_of(layers)
    try:
        seq = time_in_sequence(bundle, layers, batch, input_grads, repeats=repeats, clock=clock)
        whole = time_whole_model(bundle, layers, batch, repeats=repeats, clock=clock)
    except torch.cuda.OutOfMemoryError:
        raise ProfilingError(
            f"model {bundle.source!r}: the whole model runs out of memory on {device} "
            f"at micro-batch {batch}: profile smaller --batch-sizes"
        ) from None
    loss_ms = seq.loss_fwd_ms + seq.loss_bwd_ms
    total = sum(seq.fwd_ms) + sum(seq.bwd_ms) + loss_ms
    scale = whole.ms / total if total > 0 else 1.0
    last = len(layers) - 1
    row = [
        LayerTiming(
            device_model=device_model,
            micro_batch=batch,
            fwd_ms=(fwd + (seq.loss_fwd_ms if k == last else 0.0)) * scale,
            bwd_ms=(bwd + (seq.loss_bwd_ms if k == last else 0.0)) * scale,
            spread=round(seq.spread, 3),
        )
        for k, (fwd, bwd) in enumerate(zip(seq.fwd_ms, seq.bwd_ms))
    ]
    return row, WholeModel(scale, loss_ms * scale, max(whole.spread, seq.spread), whole.noisy or seq.noisy)


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
    clear_grads(layers)
    return Measured(statistics.median(r for (r,) in runs) * 1e3, timed.spread, timed.noisy)


def fixed_gradient(out: Any, seed: int) -> list[torch.Tensor]:
    """A seeded upstream gradient for each floating-point tensor of a layer's output."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for t in values.floating(out)]


def _device_of(layers: nn.Module) -> torch.device:
    """Where ``layers`` compute: their parameters' device (the CPU for layers without any)."""
    return next((p.device for p in layers.parameters()), torch.device("cpu"))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = [
    "DEFAULT_REPEATS",
    "Clock",
    "InSequence",
    "LayerTimes",
    "Measured",
    "WholeModel",
    "time_as_a_step",
    "time_in_sequence",
    "time_layer",
    "time_optimizer_step",
    "time_whole_model",
]
