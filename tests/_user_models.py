"""Models as a user writes them (``package.module:function``), for tests that need one."""

from __future__ import annotations

import torch
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


class LabelError(Exception):
    """An exception type of the user's own."""


def shape_slip(where: str = "loss_fn", error: str = "shape"):
    """A linear TrainJob with a slip in its ``loss_fn`` (or its ``forward``, ``collate_fn``, or
    optimizer factory) that raises on every call: ``error`` "shape", torch's own ``RuntimeError:
    The size of tensor a (2) must match the size of tensor b (16) ...``, as a user's first try at
    a loss may; "label", a :class:`LabelError`."""
    import torch
    from torch.nn import functional as F
    from torch.utils.data import default_collate

    from felactl import TrainJob

    def slip(x: torch.Tensor) -> torch.Tensor:
        if error == "label":
            raise LabelError("label 7 is not one of the 2 classes")
        return x + torch.zeros(x.shape[0], 16)  # x is (batch, 2)

    class Model(torch.nn.Linear):
        def forward(self, x):
            out = super().forward(x)
            return slip(out) if where == "forward" else out

    def loss_fn(output, targets):
        return F.cross_entropy(slip(output) if where == "loss_fn" else output, targets)

    def collate_fn(samples):
        inputs, targets = default_collate(samples)
        return (slip(inputs[:, :2]) if where == "collate_fn" else inputs), targets

    def optimizer(params):
        params = list(params)
        if where == "optimizer":
            slip(torch.zeros(1, 2))
        return torch.optim.SGD(params, lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(2, (64,), generator=g))
    return TrainJob(
        model=Model(8, 2),
        dataset=data,
        loss_fn=loss_fn,
        collate_fn=collate_fn,
        optimizer=optimizer,
    )


class Branching(nn.Module):
    """Blocks in a ModuleList, but which block runs next depends on the data: no trace can cut it."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        x = self.blocks[0](x)
        if x.sum() > 0:
            x = self.blocks[1](x)
        return self.blocks[2](x)


def branching_job():
    from felactl import TrainJob

    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 4, (16,)))
    return TrainJob(model=Branching(), dataset=data, loss_fn=nn.functional.cross_entropy)


def heavy_loss(hidden: int = 8, rounds: int = 30):
    """A small ``nn.Sequential`` whose loss costs many times its layers: the output goes through
    ``rounds`` matmuls of a fixed 256 x 256 matrix before the squared error, as a language model's
    cross-entropy over a large vocabulary outweighs a small model's blocks."""
    import torch
    from torch.nn import functional as F

    from felactl import TrainJob

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 256, generator=g))
    mixing = torch.randn(256, 256, generator=g) / 16

    def loss_fn(output, targets):
        x = output
        for _ in range(rounds):
            x = torch.tanh(x @ mixing)
        return F.mse_loss(x, targets)

    model = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 256))
    return TrainJob(model=model, dataset=data, loss_fn=loss_fn)


class Remembers(nn.Module):
    """A layer that is cheap on the input it saw last and dear on a new one (40 matmuls), as a
    layer whose weights and buffers sit in cache when it runs again at once, and not in a step:
    timed alone, again and again on one input, it looks cheap."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.seen = None

    def forward(self, x):
        key = float(x.detach().sum())
        cheap, self.seen = key == self.seen, key
        if cheap:
            return x @ self.weight
        for _ in range(40):
            x = torch.tanh(x @ self.weight)
        return x


def remembers(width: int = 64):
    """A TrainJob whose middle layer is :class:`Remembers`."""
    from torch.nn import functional as F

    from felactl import TrainJob

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 4, generator=g))
    model = nn.Sequential(nn.Linear(16, width), Remembers(width), nn.Linear(width, 4))
    return TrainJob(model=model, dataset=data, loss_fn=F.mse_loss)


def counted_builds(record: str = "", leave: str = ""):
    """A three-layer TrainJob that appends the pid of the process building it to the file
    ``record``; ``leave``: what its build leaves behind (``file``: a file open, ``memmap``: a file
    open and memory-mapped, as ``np.memmap`` leaves it, ``thread``: a thread running, ``print``: a
    line on stdout, from Python and on file descriptor 1, ``slow``: 30 s more, ``environ``: a
    variable set, ``seed``: Python's and numpy's global generators seeded, ``signal``: SIGCHLD
    ignored, ``raise``: a RuntimeError, ``cuda_check``: ``torch.cuda.is_available()`` asked, as
    libraries ask it when they import)."""
    import os
    import sys
    import threading
    import time

    from torch.nn import functional as F

    from felactl import TrainJob

    with open(record, "a") as out:
        out.write(f"{os.getpid()}\n")
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(128, 8, generator=g), torch.randn(128, 2, generator=g))
    if leave == "file":
        data.handle = open(record)  # noqa: SIM115 - left open on purpose, as a user's dataset may
    elif leave == "memmap":
        import numpy

        numpy.zeros(64, dtype=numpy.float32).tofile(f"{record}.bin")
        data.mapped = numpy.memmap(f"{record}.bin", dtype=numpy.float32, mode="r")
    elif leave == "thread":
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    elif leave == "slow":
        time.sleep(30)
    elif leave == "print":
        print("building the model", end="")
        sys.stdout.flush()
        os.write(1, b"building it on fd 1")
    elif leave == "environ":
        os.environ["COUNTED_BUILDS"] = "set by the build"
    elif leave == "seed":
        import random

        import numpy

        random.seed(0)
        numpy.random.seed(0)
    elif leave == "signal":
        import signal

        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    elif leave == "cuda_check":
        torch.cuda.is_available()
    elif leave == "raise":
        raise RuntimeError("the user's own build error")
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    return TrainJob(model=model, dataset=data, loss_fn=F.mse_loss)


def titan_llama(seq_len: int = 16, width: int = 32, depth: int = 3, num_heads: int = 2):
    """The LLaMA-shaped example laid out as torchtitan lays its models out: the blocks in a
    ``ModuleDict`` keyed "0", "1", ... (a pipeline stage there deletes the others and keeps the
    names), the forward over its values."""
    import dataclasses

    from examples.llama import Llama, job

    class TitanLlama(Llama):
        def __init__(self, *args):
            super().__init__(*args)
            self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(self.layers)})

        def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
            t = ids.shape[1]
            x, rope = self.embed(ids), (self.cos[:t], self.sin[:t])
            for block in self.layers.values():
                x = block(x, rope)
            return {"logits": self.head(self.norm(x))}

    own = job(seq_len=seq_len, width=width, depth=depth, num_heads=num_heads)
    vocab = own.model.embed.num_embeddings
    return dataclasses.replace(own, model=TitanLlama(vocab, seq_len, width, depth, num_heads, True, True))
