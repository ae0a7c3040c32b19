"""The ``--model`` branch of ``felactl profile``: parse its options, profile, write, render.

With ``--cluster`` the model is timed as the workers of this machine's CPU slots will run it
(``felactl.profiling.in_situ``): beside companions training on the other slots, plus the
data-parallel step's gradient sync measured on all of them.

The table shows, per layer, its size and FLOPs and the milliseconds per sample (forward plus
backward) at each micro-batch size: the saturation curve the planner chooses micro-batches from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich import box
from rich.console import Console
from rich.table import Table

from felactl.cli import output
from felactl.errors import InputError
from felactl.limits import split_items
from felactl.spec import ClusterSpec, ModelSpec, load_cluster, save, to_dict


def parse_config(pairs: list[str] | None) -> dict[str, Any]:
    """``["depth=2", "width=128"]`` -> ``{"depth": 2, "width": 128}`` (values read as YAML scalars)."""
    config: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--config: expected key=value, got {pair!r}")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        config[key.strip()] = value
    return config


def parse_shape(text: str | None) -> list[int] | None:
    """``"3,32,32"`` -> ``[3, 32, 32]``: the shape of one input sample, without the batch axis."""
    if text is None:
        return None
    expected = "comma-separated integers"
    try:
        shape = [int(part) for part in split_items("--input-shape", text.replace("x", ","), expected)]
    except ValueError:
        raise InputError(f"--input-shape: expected {expected}, got {text!r}") from None
    if any(d < 1 for d in shape):
        raise InputError(f"--input-shape: every dimension must be >= 1, got {text!r}")
    return shape


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True, kw_only=True)
class ModelProfileFlags:
    """``felactl profile --model``'s flags, as given: what :func:`run` profiles, writes and shows."""

    model: str
    batch_sizes: list[int]
    out: Path | None
    as_json: bool
    config: list[str] | None
    """``key=value`` pairs (:func:`parse_config`)."""
    input_shape: str | None
    """``3,32,32`` (:func:`parse_shape`)."""
    device: str
    repeats: int
    cluster: Path | None = None
    node: str | None = None
    worker_batch: int | None = None
    matmul_size: int | None = None
    testbed: str | None = None
    timeout_s: float | None = None


def run(flags: ModelProfileFlags) -> None:
    import felactl.profiling.model  # noqa: F401 (torch loads here, not on the profile's clock)

    device = _device_for(flags)
    in_cluster = load_cluster(flags.cluster) if flags.cluster is not None else None
    model = flags.model
    started = time.perf_counter()
    with output.progress() as bar:
        task = bar.add_task(f"profiling {model}", total=None)

        def on_progress(phase: str, done: int, total: int) -> None:
            bar.update(task, description=f"profiling {model}: {phase}", completed=done, total=total)

        def say_on_bar(line: str) -> None:
            bar.update(task, description=f"profiling {model}: {line}")

        spec = _profile(flags, device, in_cluster, on_progress, say_on_bar)
    profile_s = time.perf_counter() - started
    path = save(spec, flags.out or Path("model.yaml"))

    def render(console: Console) -> None:
        output.wide(console).print(layer_table(spec))
        console.print(
            f"wrote {path}: {spec.num_layers} layers, {spec.total_params:,} params, profiled in {profile_s:.1f} s",
            soft_wrap=True,
        )

    output.emit({**to_dict(spec), "path": str(path), "profile_s": round(profile_s, 3)}, flags.as_json, render)


def _device_for(flags: ModelProfileFlags) -> str:
    """The device to profile on, or :class:`InputError` where the flags do not go together."""
    device = flags.device
    if flags.testbed is not None:
        if flags.cluster is not None or flags.worker_batch is not None:
            raise InputError(
                "--testbed times the model in each node of the testbed: not with --cluster or --worker-batch"
            )
        if device not in ("auto", "cpu"):
            raise InputError(f"--testbed profiles the nodes' CPU slots; --device is {device} (use --device cpu)")
        device = "cpu"
    if flags.cluster is None and flags.worker_batch is not None:
        raise InputError("--worker-batch is for --cluster (the batch of the data-parallel sync timing)")
    if flags.cluster is not None and device == "auto":
        device = "cpu"  # in situ means this machine's CPU slots
    device = _resolve_device(device)
    if flags.cluster is not None and device != "cpu":
        raise InputError(f"--cluster profiles on this machine's CPU slots; --device is {device} (use --device cpu)")
    return device


def _profile(
    flags: ModelProfileFlags,
    device: str,
    in_cluster: ClusterSpec | None,
    on_progress,
    say_on_bar: Callable[[str], None],
) -> ModelSpec:
    """Profile the model in each node of a testbed, in situ on this machine's slots of a cluster,
    or alone on ``device``."""
    from felactl.profiling.model import profile_model

    model, batch_sizes = flags.model, flags.batch_sizes
    options = dict(
        repeats=flags.repeats,
        input_shape=parse_shape(flags.input_shape),
        progress=on_progress,
        matmul_size=flags.matmul_size,
    )
    if flags.testbed is not None:
        from felactl.launcher.testbed_model import DEFAULT_TIMEOUT_S, profile_model_on_testbed

        return profile_model_on_testbed(
            flags.testbed,
            model,
            parse_config(flags.config),
            batch_sizes,
            repeats=flags.repeats,
            matmul_size=flags.matmul_size,
            input_shape=flags.input_shape,
            timeout_s=flags.timeout_s or DEFAULT_TIMEOUT_S,
            say=say_on_bar,
        )
    if in_cluster is None:
        return profile_model(model, parse_config(flags.config), batch_sizes, device=device, **options)
    from felactl.profiling.in_situ import profile_model_in_situ

    return profile_model_in_situ(
        model,
        parse_config(flags.config),
        batch_sizes,
        in_cluster,
        node_name=flags.node,
        worker_batch=flags.worker_batch,
        say=lambda line: output.stderr.print(line),
        **options,
    )


def layer_table(spec: ModelSpec) -> Table:
    """Per layer, its sizes and its ms per sample on the first device model timed; then the whole
    model's on each device model (a profile of a testbed's nodes holds one per CPU share)."""
    device_models = sorted(spec.timed_device_models)
    batches = sorted({t.micro_batch for layer in spec.layers for t in layer.timings})
    table = Table(
        title=f"{spec.name} on {device_models[0] if device_models else '-'}",
        box=box.SIMPLE_HEAD,
        caption="KB and MFLOP per sample (saved: kept for backward); b=N: ms per sample, forward + backward, "
        "at micro-batch N"
        + (f", per layer on {device_models[0]}, in total on each device model" if len(device_models) > 1 else ""),
    )
    table.add_column("layer", no_wrap=True)
    for column in ("params", "out KB", "saved KB", "MFLOP"):
        table.add_column(column, justify="right", no_wrap=True)
    for batch in batches:
        table.add_column(f"b={batch}", justify="right", no_wrap=True)

    def per_sample(layer, device_model: str) -> dict[int, float]:
        return {
            t.micro_batch: (t.fwd_ms + t.bwd_ms) / t.micro_batch
            for t in layer.timings
            if t.device_model == device_model
        }

    for layer in spec.layers:
        times = per_sample(layer, device_models[0]) if device_models else {}
        saved_kb = "-" if layer.saved_bytes_per_sample is None else f"{layer.saved_bytes_per_sample / 1e3:,.1f}"
        table.add_row(
            layer.name,
            f"{layer.params:,}",
            f"{layer.activation_bytes_per_sample / 1e3:,.1f}",
            saved_kb,
            f"{layer.fwd_flops_per_sample / 1e6:,.1f}",
            *(f"{times[b]:.3g}" if b in times else "-" for b in batches),
        )
    flops = f"{sum(l.fwd_flops_per_sample for l in spec.layers) / 1e6:,.1f}"
    for device_model in device_models or [None]:
        totals = [0.0] * len(batches)
        for layer in spec.layers:
            times = per_sample(layer, device_model) if device_model else {}
            for i, batch in enumerate(batches):
                totals[i] += times.get(batch, 0.0)
        label = "total" if len(device_models) <= 1 else f"total on {device_model}"
        table.add_row(label, f"{spec.total_params:,}", "", "", flops, *(f"{t:.3g}" for t in totals), style="bold")
    return table
