"""Models a user would bring (``user_models:attention_net``): layers torch initialises itself
(``nn.MultiheadAttention``'s packed projection, ``nn.LayerNorm``), buffers, and data by index."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn import functional as F

from felactl import TrainJob


class SelfAttention(nn.Module):
    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(width, num_heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(x, x, x, need_weights=False)
        return x + out


class MeanPool(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1) * self.scale


class Sequences:
    """Sample ``i`` is a fixed function of ``i`` alone, as a map-style dataset's would be."""

    def __init__(self, seq_len: int, width: int, num_classes: int):
        self.seq_len, self.width, self.num_classes = seq_len, width, num_classes

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(int(i))
        x = torch.randn(self.seq_len, self.width, generator=g)
        return x, torch.tensor(int(x[:, 0].sum() > 0) + 2 * int(x[:, 1].sum() > 0))


def attention_net(
    width: int = 16, num_heads: int = 2, seq_len: int = 6, num_classes: int = 4, per_process_noise: int = 0
):
    """``per_process_noise`` 1: every process starts from other weights and buffers (a user whose
    initialisation differs between processes): only felactl's start-up broadcast makes the replicas
    agree. The noise is seeded by the worker's rank, so that a second run of the plan starts as the
    first did."""
    layers = nn.Sequential(
        SelfAttention(width, num_heads),
        nn.LayerNorm(width),
        SelfAttention(width, num_heads),
        MeanPool(width),
        nn.Linear(width, num_classes),
    )
    if per_process_noise:
        g = torch.Generator().manual_seed(1000 + int(os.environ.get("RANK", "-1")))
        with torch.no_grad():
            for tensor in [*layers.parameters(), *layers.buffers()]:
                tensor.add_(0.1 * torch.randn(tensor.shape, generator=g))
    return TrainJob(model=layers, dataset=Sequences(seq_len, width, num_classes), loss_fn=F.cross_entropy)


def pretrained_net():
    """A model whose function loads its weights (here: all 0.25), which felactl must keep."""
    layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        for p in layers.parameters():
            p.fill_(0.25)
    return layers


def batchnorm_net(width: int = 16, seq_len: int = 6, num_classes: int = 4):
    """BatchNorm's running statistics: buffers each replica updates from its own samples."""
    layers = nn.Sequential(
        MeanPool(width), nn.Linear(width, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, num_classes)
    )
    return TrainJob(model=layers, dataset=Sequences(seq_len, width, num_classes), loss_fn=F.cross_entropy)
