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


__all__ = [
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
