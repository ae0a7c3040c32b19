"""Models as a user writes them (``package.module:function``), for tests that need one."""

from __future__ import annotations

from torch import nn


def cnn(width: int = 4, num_classes: int = 10) -> nn.Sequential:
    """Each child one layer of the plan; ``Flatten`` (layer 2) holds no parameter."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(width * 8 * 8, num_classes)
    )


class SlowFirstForward(nn.Module):
    """A linear model whose first forward on worker 1 takes ``delay_s`` (as a first step that
    compiles or autotunes does): the other worker waits that long in its first collective."""

    def __init__(self, delay_s: float):
        super().__init__()
        self.linear = nn.Linear(8, 2)
        self.delay_s = delay_s
        self.first = True

    def forward(self, x):
        import os
        import time

        if self.first and os.environ.get("FELACTL_WORKER_ID") == "1":
            time.sleep(self.delay_s)
        self.first = False
        return self.linear(x)


def slow_first_step(delay_s: float = 3.0):
    """A TrainJob of :class:`SlowFirstForward` on 256 random samples."""
    import functools

    import torch
    from torch.nn import functional as F

    from felactl import TrainJob

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=g), torch.randint(2, (256,), generator=g))
    return TrainJob(
        model=SlowFirstForward(delay_s),
        dataset=data,
        loss_fn=F.cross_entropy,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
    )


def few_samples(num_samples: int = 10):
    """A TrainJob of a linear model on ``num_samples`` random samples: fewer than most batches."""
    import torch
    from torch.nn import functional as F

    from felactl import TrainJob

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(num_samples, 8, generator=g), torch.randint(2, (num_samples,), generator=g)
    )
    return TrainJob(model=nn.Linear(8, 2), dataset=data, loss_fn=F.cross_entropy)


def short_data(num_samples: int = 64):
    """A TrainJob whose dataset is short (``num_samples``): a run of a few dozen steps goes
    around it many times, as a small user dataset does."""
    import functools

    import torch
    from torch.nn import functional as F

    from felactl import TrainJob

    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(num_samples, 16, generator=g)
    data = torch.utils.data.TensorDataset(inputs, (inputs[:, 0] + inputs[:, 1] > 0).long())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2))
    return TrainJob(
        model=model, dataset=data, loss_fn=F.cross_entropy, optimizer=functools.partial(torch.optim.SGD, lr=0.1)
    )
