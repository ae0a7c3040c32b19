"""One model profile from several: the same model timed on different devices (each node of a
testbed, ``felactl profile --model --testbed``), as Fela profiles each type of device it plans for.

The profiles must describe the same model (name, source, config and every layer's sizes and
FLOPs); the result holds each layer's timings of every device model, each device model's matmul
rate (``timed_tflops``) and optimizer step (``optimizer_step_ms_by_device_model``). Where several
sources report one device model (nodes at the same CPU share), a timing is the median of theirs:
the devices are alike, and one node's slice of a busy machine is no better than another's.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import replace

from felactl.errors import ProfilingError
from felactl.spec import LayerTiming, ModelSpec

_SAME_LAYER = ("name", "params", "param_bytes", "activation_bytes_per_sample", "fwd_flops_per_sample")


def merge_device_profiles(profiles: Mapping[str, ModelSpec]) -> ModelSpec:
    """``source name -> profile`` (a node's name, say) into one profile (module doc)."""
    if not profiles:
        raise ProfilingError("no profiles to merge")
    (first_source, first), *others = profiles.items()
    for source, spec in others:
        _check_same_model(first_source, first, source, spec)
    layers = tuple(
        replace(layer, timings=_merged_timings([spec.layers[i].timings for spec in profiles.values()]))
        for i, layer in enumerate(first.layers)
    )
    tflops: dict[str, list[float]] = {}
    steps: dict[str, list[float]] = {}
    for spec in profiles.values():
        for device_model, rate in spec.timed_tflops.items():
            tflops.setdefault(device_model, []).append(rate)
        for device_model in spec.timed_device_models:
            step = spec.optimizer_step_ms_of(device_model)
            if step is not None:
                steps.setdefault(device_model, []).append(step)
    noisy = tuple(f"{source}: {entry}" for source, spec in profiles.items() for entry in spec.noisy)
    return replace(
        first,
        layers=layers,
        optimizer_step_ms=None,
        optimizer_step_ms_by_device_model={m: statistics.median(v) for m, v in sorted(steps.items())},
        timed_tflops={m: float(f"{statistics.median(v):.4g}") for m, v in sorted(tflops.items())},
        whole_model_scale={},  # records of one device's scaling; per device they would say little
        loss_ms={},
        data_parallel_sync=tuple(t for spec in profiles.values() for t in spec.data_parallel_sync),
        noisy=noisy,
    )


def _merged_timings(per_source: list[tuple[LayerTiming, ...]]) -> tuple[LayerTiming, ...]:
    grouped: dict[tuple[str, int], list[LayerTiming]] = {}
    for timings in per_source:
        for t in timings:
            grouped.setdefault((t.device_model, t.micro_batch), []).append(t)
    merged = []
    for (device_model, micro_batch), found in sorted(grouped.items()):
        spreads = [t.spread for t in found if t.spread is not None]
        merged.append(
            LayerTiming(
                device_model=device_model,
                micro_batch=micro_batch,
                fwd_ms=statistics.median(t.fwd_ms for t in found),
                bwd_ms=statistics.median(t.bwd_ms for t in found),
                spread=max(spreads) if spreads else None,
            )
        )
    return tuple(merged)


def _check_same_model(a_source: str, a: ModelSpec, b_source: str, b: ModelSpec) -> None:
    def differ(what: str) -> ProfilingError:
        return ProfilingError(f"the profiles of {a_source} and {b_source} are of different models: {what} differ")

    for key in ("name", "source", "config", "input_bytes_per_sample", "splittable", "tied"):
        if getattr(a, key) != getattr(b, key):
            raise differ(key)
    if len(a.layers) != len(b.layers):
        raise differ("their layer counts")
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        if any(getattr(x, key) != getattr(y, key) for key in _SAME_LAYER):
            raise differ(f"layers[{i}]")


__all__ = ["merge_device_profiles"]
