"""Models as a user writes them (``package.module:function``), for tests that need one."""

from __future__ import annotations

from torch import nn


def cnn(width: int = 4, num_classes: int = 10) -> nn.Sequential:
    """Each child one layer of the plan; ``Flatten`` (layer 2) holds no parameter."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(width * 8 * 8, num_classes)
    )
