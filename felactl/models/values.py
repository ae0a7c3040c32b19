"""What flows between layers and stages: one tensor (an ``nn.Sequential``'s layers), or any
structure of tensors and numbers (a split model's live values, a model's ``ModelOutput``).
These helpers treat both alike, through torch's pytree."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, in pytree order."""
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(value))


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    return pytree.tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, value)


def to_device(value: Any, device: torch.device) -> Any:
    return map_tensors(lambda t: t.to(device), value)


def cut_from_graph(value: Any, requires_grad: bool) -> Any:
    """``value`` detached; its floating-point tensors require grad where ``requires_grad`` (as a
    stage's input does mid-model: its gradient goes back to the previous stage)."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.requires_grad_(True) if requires_grad and t.is_floating_point() else t

    return map_tensors(cut, value)


def floating(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors of ``value``: those a gradient comes back for."""
    return [t for t in tensors(value) if t.is_floating_point()]


def requires_grad(value: Any) -> bool:
    return any(t.requires_grad for t in tensors(value))


def backward(out: Any, grads: list[torch.Tensor]) -> None:
    """Backward from ``out`` with ``grads``, one per floating-point tensor of it in order (those
    that do not require grad, as values computed from buffers only, are passed over)."""
    pairs = [(t, g) for t, g in zip(floating(out), grads, strict=True) if t.requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def input_grads(inputs: Any) -> list[torch.Tensor]:
    """The gradients of ``inputs``' floating-point tensors, in order (zeros where autograd left
    none: a value no weight's path reached, as rotary tables): what goes back to the stage before."""
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in floating(inputs)]


BATCHED, SHARED, SIZE = "batched", "shared", "size"
"""How a value crossing a cut relates to the micro-batch: a tensor whose first axis is the
samples; a tensor or number the same for any batch (a rotary table, the sequence length); the
number of samples itself (:func:`felactl.models.split.value_kinds` tells them apart). Tokens of
several micro-batches merge by these (the flexible hybrid)."""


def merge(parts: list[Any], kinds: list[str] | None) -> Any:
    """Several micro-batches' values at one cut as one micro-batch's: tensors concatenated, or
    each value by its kind (:data:`BATCHED` ones concatenated, the number of
    samples summed, the rest taken from the first, as they are the same)."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    merged = []
    for i, kind in enumerate(kinds):
        items = [part[i] for part in parts]
        merged.append(torch.cat(items) if kind == BATCHED else sum(items) if kind == SIZE else items[0])
    return tuple(merged)


def samples_in(value: Any, kinds: list[str] | None) -> int:
    """How many samples a micro-batch's value holds."""
    if isinstance(value, torch.Tensor):
        return value.shape[0]
    return next(item.shape[0] for item, kind in zip(value, kinds) if kind == BATCHED)


def split_input_grads(inputs: Any, kinds: list[str] | None, sizes: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """:func:`input_grads` of a merged micro-batch (:func:`merge`), one tuple per part: a
    batched value's gradient split by the parts' ``sizes``; a shared one's whole to the first part
    and zeros to the others (the parts made equal copies of it: the sum reaches its makers once)."""
    items = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    item_kinds = [BATCHED] if isinstance(inputs, torch.Tensor) else kinds
    floats = [(t, k) for t, k in zip(items, item_kinds) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    per_part: list[list[torch.Tensor]] = [[] for _ in sizes]
    for tensor, kind in floats:
        grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
        pieces = grad.split(sizes) if kind == BATCHED else [grad] + [torch.zeros_like(grad)] * (len(sizes) - 1)
        for q, piece in enumerate(pieces):
            per_part[q].append(piece)
    return [tuple(p) for p in per_part]


__all__ = [
    "BATCHED",
    "SHARED",
    "SIZE",
    "merge",
    "samples_in",
    "split_input_grads",
    "backward",
    "cut_from_graph",
    "floating",
    "input_grads",
    "map_tensors",
    "nbytes",
    "requires_grad",
    "tensors",
    "to_device",
]
