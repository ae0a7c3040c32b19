"""The built-in models: each an ``nn.Sequential`` whose children are the layers felactl plans.

``gpt-mini``: a small decoder-only transformer on the character corpus (depth is a parameter).
``vgg-mini``: conv blocks, then large fully connected layers (Fela's motivating shape).
``mlp``: a plain multi-layer perceptron on a teacher-labelled synthetic set.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class TokenEmbedding(nn.Module):
    """Token plus learned position embedding: (batch, seq) ids -> (batch, seq, width)."""

    def __init__(self, vocab_size: int, width: int, seq_len: int):
        super().__init__()
        self.token = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(seq_len, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.token(ids) + self.position(positions)[None]


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        shape = (b, t, self.num_heads, c // self.num_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class LMHead(nn.Module):
    def __init__(self, width: int, vocab_size: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def gpt_mini(
    vocab_size: int = 103, depth: int = 4, width: int = 256, num_heads: int = 4, seq_len: int = 64
) -> nn.Sequential:
    if width % num_heads:
        raise ValueError(f"width ({width}) must be divisible by num_heads ({num_heads})")
    layers = [TokenEmbedding(vocab_size, width, seq_len)]
    layers += [Block(width, num_heads) for _ in range(depth)]
    layers.append(LMHead(width, vocab_size))
    return nn.Sequential(*layers)


def _conv(c_in: int, c_out: int, pool: bool) -> nn.Sequential:
    parts = [nn.Conv2d(c_in, c_out, kernel_size=3, padding=1), nn.ReLU()]
    if pool:
        parts.append(nn.MaxPool2d(2))
    return nn.Sequential(*parts)


def vgg_mini(num_classes: int = 10, image_size: int = 32, width: int = 32, fc_width: int = 1024) -> nn.Sequential:
    """Six conv layers in three pooled blocks, then three fully connected layers."""
    if image_size < 8:
        raise ValueError(f"image_size must be >= 8 (three 2x poolings), got {image_size}")
    w = width
    convs = [
        _conv(3, w, False),
        _conv(w, w, True),
        _conv(w, 2 * w, False),
        _conv(2 * w, 2 * w, True),
        _conv(2 * w, 4 * w, False),
        _conv(4 * w, 4 * w, True),
    ]
    flat = 4 * w * (image_size // 8) ** 2
    fcs = [
        nn.Sequential(nn.Flatten(), nn.Linear(flat, fc_width), nn.ReLU()),
        nn.Sequential(nn.Linear(fc_width, fc_width), nn.ReLU()),
        nn.Linear(fc_width, num_classes),
    ]
    return nn.Sequential(*convs, *fcs)


def mlp(input_dim: int = 256, hidden: int = 512, depth: int = 4, num_classes: int = 10) -> nn.Sequential:
    dims = [input_dim] + [hidden] * depth
    layers = [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(dims, dims[1:])]
    layers.append(nn.Linear(dims[-1], num_classes))
    return nn.Sequential(*layers)


def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic initialisation: the same seed gives the same weights on every worker."""
    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            fan_in = module.weight[0].numel()
            nn.init.normal_(module.weight, std=1.0 / math.sqrt(fan_in))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
