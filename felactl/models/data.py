"""Training data that needs no download: map-style datasets, each sample ``(input, target)``.

Every sample has an index; the samples of step k are ``k * global_batch + i`` (wrapping around the
data, :meth:`felactl.TrainJob.batch`). Any worker can therefore fetch exactly its share of a step,
and a run on N workers sees the very same samples as a run on one, which is what lets tests
compare distributed training with single-process.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch.nn import functional as F

NUM_SAMPLES = 8192
"""Samples of each synthetic set (the teacher's, the images')."""
FLOAT_BYTES = 4
"""An fp32 number: what the synthetic sets are made of."""


@functools.lru_cache(maxsize=1)
def python_docs_text() -> str:
    """The documentation topics that CPython ships (``pydoc_data``): ~460 kB of English prose."""
    import pydoc_data.topics

    return "".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))


class CharCorpus:
    """Character-level language modelling on the Python docs: predict the next character."""

    def __init__(self, seq_len: int):
        text = python_docs_text()
        self.vocab = sorted(set(text))
        index = {ch: i for i, ch in enumerate(self.vocab)}
        self.tokens = torch.tensor([index[ch] for ch in text], dtype=torch.long)
        self.seq_len = seq_len
        self.num_windows = len(self.tokens) - seq_len - 1

    @staticmethod
    def nbytes() -> int:
        """Bytes the corpus holds (a token id, int64, per character), without building it."""
        return 8 * len(python_docs_text())

    def __len__(self) -> int:
        return self.num_windows

    def _start(self, index: int) -> int:
        # A fixed stride co-prime with the corpus length visits windows in a scattered but
        # deterministic order, so consecutive steps do not read neighbouring text.
        return (index * 7919) % self.num_windows

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self._start(index)
        window = self.tokens[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


class TeacherDataset:
    """A learnable synthetic classification set: inputs are seeded noise, labels come from a
    fixed random teacher network, so a student can drive the loss well below chance."""

    TEACHER_WIDTH = 64

    def __init__(self, input_shape: Sequence[int], num_classes: int, num_samples: int = NUM_SAMPLES, seed: int = 1234):
        gen = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn((num_samples, *input_shape), generator=gen)
        flat = self.inputs.reshape(num_samples, -1)
        teacher = torch.randn(flat.shape[1], self.TEACHER_WIDTH, generator=gen)
        hidden = torch.tanh(flat @ teacher / flat.shape[1] ** 0.5)
        logits = hidden @ torch.randn(self.TEACHER_WIDTH, num_classes, generator=gen)
        self.labels = logits.argmax(dim=1)

    @classmethod
    def nbytes(cls, input_shape: Sequence[int], num_samples: int = NUM_SAMPLES) -> int:
        """Bytes its inputs and its teacher's first layer take, without building them."""
        return FLOAT_BYTES * math.prod(input_shape) * (num_samples + cls.TEACHER_WIDTH)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]


class PrototypeImages:
    """A learnable synthetic image set: each class is a smooth random pattern (4x4 noise scaled up),
    each sample its class's pattern under strong pixel noise. Convolutions find the pattern, so a
    few hundred steps take the loss far below chance; the noise keeps it from being instant.

    (A teacher network's labels on pure-noise images, as :class:`TeacherDataset` gives, are not
    learnable by a conv net in a few hundred steps: the loss stays at chance.)
    """

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        num_samples: int = NUM_SAMPLES,
        seed: int = 1234,
        noise_std: float = 3.0,
    ):
        channels, height, width = input_shape
        gen = torch.Generator().manual_seed(seed)
        coarse = torch.randn((num_classes, channels, 4, 4), generator=gen)
        self.prototypes = F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
        self.labels = torch.randint(num_classes, (num_samples,), generator=gen)
        noise = torch.randn((num_samples, channels, height, width), generator=gen)
        self.inputs = self.prototypes[self.labels] + noise_std * noise

    @staticmethod
    def nbytes(input_shape: Sequence[int], num_classes: int, num_samples: int = NUM_SAMPLES) -> int:
        """Bytes it takes while it is built, without building it: the noise, each sample's class
        pattern and their sum are held at once, beside the class patterns."""
        return FLOAT_BYTES * math.prod(input_shape) * (3 * num_samples + num_classes)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]
