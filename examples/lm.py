"""A small decoder-only transformer LM, by characters, on the source of Python's ``textwrap``.

    felactl launch --job examples.lm:job --nproc-per-node 2 --global-batch 16 --steps 50

Causal self-attention (``scaled_dot_product_attention``), 3-D logits with their own loss, AdamW
with a warmup + cosine schedule, and gradient clipping. The model is a plain ``nn.Module`` with its
blocks in a ``ModuleList``: felactl profiles and plans it per block (the embeddings, each block,
the head), as it does ``examples/llama.py``.
"""

from __future__ import annotations

import functools
import inspect
import math
import textwrap

import torch
from torch import nn
from torch.nn import functional as F

from felactl import TrainJob


class Chars(torch.utils.data.Dataset):
    """Windows of ``seq_len + 1`` characters; sample ``i`` starts at ``i * stride`` (wrapping)."""

    def __init__(self, text: str, seq_len: int):
        self.vocab = sorted(set(text))
        index = {ch: k for k, ch in enumerate(self.vocab)}
        self.tokens = torch.tensor([index[ch] for ch in text])
        self.seq_len, self.stride = seq_len, max(1, seq_len // 2)
        self.num_windows = (len(self.tokens) - seq_len - 1) // self.stride

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.stride
        window = self.tokens[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


class Block(nn.Module):
    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.num_heads, -1).transpose(1, 2) for z in self.qkv(self.norm1(x)).split(c, dim=2))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class CharLM(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, width: int, depth: int, num_heads: int):
        super().__init__()
        self.token, self.position = nn.Embedding(vocab_size, width), nn.Embedding(seq_len, width)
        self.blocks = nn.ModuleList(Block(width, num_heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.token(ids) + self.position(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (batch, seq, vocab)


def next_char_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """The LR factor at ``step``: linear warmup, then cosine down to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def job(
    seq_len: int = 32,
    width: int = 64,
    depth: int = 2,
    num_heads: int = 4,
    lr: float = 3e-3,
    warmup: int = 10,
    total_steps: int = 200,
    max_grad_norm: float = 1.0,
) -> TrainJob:
    data = Chars(inspect.getsource(textwrap), seq_len)
    schedule = functools.partial(warmup_cosine, warmup=warmup, total=total_steps)
    return TrainJob(
        model=CharLM(len(data.vocab), seq_len, width, depth, num_heads),
        dataset=data,
        loss_fn=next_char_loss,
        optimizer=functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.01),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        max_grad_norm=max_grad_norm,
    )
