"""A small CNN classifier on images generated in code: stripes, one orientation per class.

    felactl launch --job examples.cnn:job --nproc-per-node 2 --global-batch 32 --steps 40

The model is an ``nn.Sequential``, so plans may also cut it into pipeline stages.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import default_collate

from felactl import TrainJob

NUM_CLASSES = 4


class Stripes(torch.utils.data.Dataset):
    """Sample ``i``: a noisy 16x16 image of stripes whose orientation is its class; a function of
    ``i`` alone (its own seeded generator), as felactl's data order needs."""

    def __init__(self, size: int = 16, num_samples: int = 4096, noise: float = 0.8):
        self.size, self.num_samples, self.noise = size, num_samples, noise

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        label = int(torch.randint(NUM_CLASSES, (), generator=g))
        y, x = torch.meshgrid(torch.arange(self.size), torch.arange(self.size), indexing="ij")
        phase = float(torch.rand((), generator=g)) * 6.28
        along = (y, x, x + y, x - y)[label].float()
        image = torch.sin(along * 1.2 + phase) + self.noise * torch.randn(self.size, self.size, generator=g)
        return image[None], label


HELD_OUT = Stripes(num_samples=256)
"""Images the job never trains on: ``Stripes`` seeds sample ``i`` by ``i``, and training reads
indices below 4096, so these are drawn from indices 1_000_000 on."""


def accuracy(model: nn.Module, step: int) -> dict[str, float]:
    """The evaluate hook: loss and accuracy on held-out images (felactl calls it in eval mode,
    under no_grad, on one worker). A user would log to W&B or MLflow here too."""
    images, labels = default_collate([HELD_OUT[1_000_000 + i] for i in range(len(HELD_OUT))])
    device = next(model.parameters()).device  # the worker's: a GPU in a plan of GPUs
    logits, labels = model(images.to(device)), labels.to(device)
    return {
        "val_loss": F.cross_entropy(logits, labels).item(),
        "val_accuracy": (logits.argmax(1) == labels).float().mean().item(),
    }


def job(width: int = 8, lr: float = 0.05, evaluate_every: int = 10) -> TrainJob:
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 4 * 4, NUM_CLASSES)),
    )
    return TrainJob(
        model=model,
        dataset=Stripes(),
        loss_fn=F.cross_entropy,
        optimizer=functools.partial(torch.optim.SGD, lr=lr, momentum=0.9),
        evaluate=accuracy,
        evaluate_every=evaluate_every,
    )
