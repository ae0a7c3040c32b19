"""How long one micro-batch of a layer takes on a device: the cost model's compute formula.

Pure: stdlib, never torch. Times in seconds. :class:`felactl.optimizer.cost.CostModel` sums these
over a stage's layers and scales measured timings to the device they price (its module docstring,
**Compute**).

**Compute** of layer ``l`` on device ``d`` at micro-batch ``b``, per sample:
measured ``(fwd_ms + bwd_ms) / b`` where the model profile has a timing for ``d.model`` at
``b``; between two measured sizes, the per-sample time interpolated linearly in log2 b (the
curve below is a GPU's: on a CPU, which saturates at small batches, it made a micro-batch
between two measured ones up to a third too fast); outside them, the nearest one (in log2 b)
scaled by the saturation curve ``eff(b_meas) / eff(b)``, except above the largest size
measured on a CPU, where a sample costs what it cost there (the curve made 512 twice as cheap
per sample as a measured 64); else ``flops / (tflops * 1e12 * eff(b))``.
The saturation curve is ``eff(b) = b / (b + b_half)``. ``b_half`` is derived per layer from its
arithmetic intensity rather than from a table of kinds: a layer reuses each weight byte
``i = fwd_flops_per_sample / param_bytes`` times per sample, and a device saturates once
``b * i`` reaches its ridge point (``RIDGE_FLOPS_PER_BYTE``), so ``b_half = RIDGE / i``,
clamped to [``B_HALF_MIN``, ``B_HALF_MAX``]. A linear layer (i = 0.5) gets b_half = 100 and
saturates only at large batches; a 32x32 conv (i ~ 500) saturates at once: Fela's observation.
"""

from __future__ import annotations

import math

from felactl.spec import Device, DeviceKind, Layer

RIDGE_FLOPS_PER_BYTE = 50.0
"""FLOPs per weight byte a device needs to be compute-bound (typical GPU ridge point ~ 10-100)."""
B_HALF_MIN = 0.5
B_HALF_MAX = 4096.0


def b_half(layer: Layer) -> float:
    """Micro-batch at which ``layer`` reaches half its device's throughput (see module doc)."""
    if layer.param_bytes <= 0 or layer.fwd_flops_per_sample <= 0:
        return B_HALF_MIN
    intensity = layer.fwd_flops_per_sample / layer.param_bytes
    return min(max(RIDGE_FLOPS_PER_BYTE / intensity, B_HALF_MIN), B_HALF_MAX)


def efficiency(micro_batch: float, half: float) -> float:
    """Fraction of peak throughput a layer with ``b_half = half`` reaches at ``micro_batch``."""
    return micro_batch / (micro_batch + half)


def layer_times_s(layer: Layer, device: Device, micro_batch: int, timed_as: str | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch of ``layer`` on ``device``, from the
    timings of device model ``timed_as`` (default: the device's own) where there are some."""
    timed_as = device.model if timed_as is None else timed_as
    measured = {t.micro_batch: t for t in layer.timings if t.device_model == timed_as}
    if micro_batch in measured:
        t = measured[micro_batch]
        return t.fwd_ms / 1e3, t.bwd_ms / 1e3
    below = [b for b in measured if b < micro_batch]
    above = [b for b in measured if b > micro_batch]
    if below and above:
        # Between two measured sizes: per-sample time interpolated in log2(b), the curve not needed.
        lo, hi = measured[max(below)], measured[min(above)]
        w = math.log2(micro_batch / lo.micro_batch) / math.log2(hi.micro_batch / lo.micro_batch)

        def per_sample(a: float, b: float) -> float:
            return (1 - w) * a / lo.micro_batch + w * b / hi.micro_batch

        return (
            per_sample(lo.fwd_ms, hi.fwd_ms) * micro_batch / 1e3,
            per_sample(lo.bwd_ms, hi.bwd_ms) * micro_batch / 1e3,
        )
    half = b_half(layer)
    if measured:
        nearest = min(measured, key=lambda b: (abs(math.log2(b / micro_batch)), b))
        t = measured[nearest]
        scale = micro_batch / nearest
        if not (device.kind == DeviceKind.CPU and micro_batch > nearest):
            # The saturation curve, except beyond the largest size measured on a CPU: a CPU is
            # saturated by the sizes a profile measures, so a sample costs what it cost there (the
            # curve made a user's micro-batch 512 2.1x cheaper per sample than the measured 64).
            scale *= efficiency(nearest, half) / efficiency(micro_batch, half)
        return t.fwd_ms / 1e3 * scale, t.bwd_ms / 1e3 * scale
    rate = device.tflops * 1e12 * efficiency(micro_batch, half)
    return (layer.fwd_flops_per_sample * micro_batch / rate, layer.bwd_flops_per_sample * micro_batch / rate)
