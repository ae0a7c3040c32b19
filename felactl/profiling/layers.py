"""A model's layers one by one, and what each costs whatever the micro-batch: parameters, output
bytes per sample (what crosses a stage boundary), bytes kept for backward per sample (the memory of
a micro-batch in flight) and FLOPs per sample (to scale to devices never profiled).

FLOPs come from torch's own ``FlopCounterMode`` (with the CPU flash-attention kernels, which it
does not know, mapped to its attention formulas), never from hand formulas. Running one layer on
its own (:func:`forward`, :func:`leaf`) is shared with the timings (:mod:`~felactl.profiling.model_timing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter

from felactl.errors import InputError
from felactl.models import ModelBundle, values


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


def count_flops(layer: nn.Module, inputs: Any, *, input_grad: bool = True) -> tuple[int, int, Any]:
    """Forward and backward FLOPs of ``layer`` on this batch, and its output (detached).

    ``input_grad=False`` for the first layer: its input is data, so backward computes only the
    weight gradients there.
    """
    inp = leaf(inputs, input_grad)
    with flop_counter.FlopCounterMode(display=False, custom_mapping=_flop_mapping()) as counter:
        out = forward(layer, inp)
    fwd_flops = counter.get_total_flops()
    bwd_flops = 0
    if values.requires_grad(out):
        with flop_counter.FlopCounterMode(display=False, custom_mapping=_flop_mapping()) as counter:
            values.backward(out, [torch.ones_like(t) for t in values.floating(out)])
        bwd_flops = counter.get_total_flops()
    clear_grads(layer)
    return fwd_flops, bwd_flops, values.cut_from_graph(out, False)


def saved_bytes(layer: nn.Module, inputs: Any, *, input_grad: bool = True) -> int:
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
        forward(layer, leaf(inputs, input_grad))
    return sum(saved.values())


@dataclass
class LayerStatic:
    """What a layer costs regardless of micro-batch size."""

    name: str
    kind: str
    params: int
    param_bytes: int
    activation_bytes_per_sample: int
    saved_bytes_per_sample: int
    fwd_flops_per_sample: float
    bwd_flops_per_sample: float


def input_grads_needed(layers: nn.Sequential) -> list[bool]:
    """Whether each layer's backward must produce its input's gradient: only if a trainable
    layer comes before it (before the first one, everything is data)."""
    needed, seen_params = [], False
    for layer in layers:
        needed.append(seen_params)
        seen_params = seen_params or any(p.requires_grad for p in layer.parameters())
    return needed


def profile_static(
    bundle: ModelBundle,
    layers: nn.Sequential,
    batch: int,
    input_shape: Sequence[int] | None,
    input_grads: list[bool],
    device: torch.device,
    seed: int,
) -> list[LayerStatic]:
    hidden = example_input(bundle, batch, input_shape, device, seed)
    statics = []
    for i, (child_name, layer) in enumerate(zip(bundle.layer_names, layers)):
        try:
            fwd_flops, bwd_flops, out = count_flops(layer, hidden, input_grad=input_grads[i])
            saved = saved_bytes(layer, hidden, input_grad=input_grads[i])
        except InputError as exc:
            raise InputError(f"model {bundle.source!r}: layer {i}: {exc}") from None
        trainable = [p for p in layer.parameters() if p.requires_grad]
        kind = layer_kind(layer)
        statics.append(
            LayerStatic(
                name=child_name if not child_name.isdigit() else f"{i}.{kind}",
                kind=kind,
                params=sum(p.numel() for p in trainable),
                param_bytes=sum(p.numel() * p.element_size() for p in trainable),
                activation_bytes_per_sample=max(1, values.nbytes(out) // batch),
                saved_bytes_per_sample=saved // batch,
                fwd_flops_per_sample=fwd_flops / batch,
                bwd_flops_per_sample=bwd_flops / batch,
            )
        )
        hidden = out
    return statics


def layer_kind(layer: nn.Module) -> str:
    """Class name; for a plain ``nn.Sequential`` the names of its parts (``Conv2d+ReLU``); for a
    split model's layer, what it holds (:attr:`felactl.models.split.SplitStage.kind`)."""
    if type(layer) is nn.Sequential:
        return "+".join(type(part).__name__ for part in layer)
    return getattr(layer, "kind", None) or type(layer).__name__


def example_input(
    bundle: ModelBundle, batch: int, input_shape: Sequence[int] | None, device: torch.device, seed: int
) -> Any:
    if bundle.data is not None:
        inputs, _targets = bundle.data.batch(range(batch))
    else:
        gen = torch.Generator().manual_seed(seed)
        inputs = torch.randn((batch, *input_shape), generator=gen)
    return values.to_device(inputs, device)


def forward(layer: nn.Module, inputs: Any) -> Any:
    """``layer(inputs)``: one tensor to one tensor for an ``nn.Sequential``'s layers; any values
    to any values for a split model's (:mod:`felactl.models.split`)."""
    try:
        out = layer(inputs)
    except Exception as exc:
        shapes = ", ".join(str(tuple(t.shape)) for t in values.tensors(inputs))
        raise InputError(
            f"{layer_kind(layer)} failed on an input of shape {shapes}: {type(exc).__name__}: {exc}".splitlines()[0]
        ) from None
    if not values.tensors(out):
        raise InputError(
            f"layer {layer_kind(layer)} returned {type(out).__name__}, expected a tensor "
            f"(each layer of a felactl model maps a tensor to a tensor)"
        )
    return out


def leaf(inputs: Any, requires_grad: bool) -> Any:
    """The layer input cut from any graph; it requires grad as a layer's input does mid-model."""
    return values.cut_from_graph(inputs, requires_grad)


def clear_grads(layer: nn.Module) -> None:
    for p in layer.parameters():
        p.grad = None


def tensor_bytes(value: Any) -> int:
    return values.nbytes(value)


__all__ = ["LayerStatic", "count_flops", "profile_static", "saved_bytes"]
