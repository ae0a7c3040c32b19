"""A LLaMA-shaped LM by characters: the model class a user brings, split into pipeline stages.

    felactl profile --model examples.llama:job -o model.yaml
    felactl plan cluster.yaml model.yaml -o plan.yaml

Token embedding, a ``ModuleList`` of blocks (RMSNorm, causal attention with rotary positions or
learned ones, a SwiGLU MLP), a final norm and a head tied to the embedding, returning a dict: the
shape of torchtitan's and Hugging Face's LLaMA. felactl finds ``layers`` as the model's blocks and
profiles and plans the embedding, each block and the head as layers; the tied head's gradient is
summed over the first and last stage. Nothing here is written for felactl but the ``TrainJob``.
"""

from __future__ import annotations

import functools
import inspect
import textwrap

import torch
from torch import nn
from torch.nn import functional as F

from examples.lm import Chars, warmup_cosine
from felactl import TrainJob


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


class Attention(nn.Module):
    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (proj(x).view(b, t, self.num_heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        if rope is not None:
            cos, sin = rope
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(attended.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attention = Attention(width, num_heads)
        hidden = 2 * width
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, width: int, depth: int, num_heads: int, rope: bool, tied: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        nn.init.normal_(self.embed.weight, std=0.02)  # it is the head too: logits start near zero
        self.position = None if rope else nn.Embedding(seq_len, width)
        if rope:
            cos, sin = rotary_tables(seq_len, width // num_heads)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        self.layers = nn.ModuleList(Block(width, num_heads) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        t = ids.shape[1]
        x = self.embed(ids)
        rope = None
        if self.position is not None:
            x = x + self.position(torch.arange(t, device=ids.device))
        else:
            rope = (self.cos[:t], self.sin[:t])
        for block in self.layers:
            x = block(x, rope)
        return {"logits": self.head(self.norm(x))}


def next_char_loss(out: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out["logits"].flatten(0, 1), targets.flatten())


def job(
    seq_len: int = 32,
    width: int = 64,
    depth: int = 4,
    num_heads: int = 4,
    rope: bool = True,
    tied: bool = True,
    lr: float = 3e-3,
    warmup: int = 10,
    total_steps: int = 200,
    max_grad_norm: float = 1.0,
    precision: str = "fp32",
) -> TrainJob:
    data = Chars(inspect.getsource(textwrap), seq_len)
    schedule = functools.partial(warmup_cosine, warmup=warmup, total=total_steps)
    return TrainJob(
        model=Llama(len(data.vocab), seq_len, width, depth, num_heads, rope, tied),
        dataset=data,
        loss_fn=next_char_loss,
        optimizer=functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.01),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        max_grad_norm=max_grad_norm,
        precision=precision,  # bf16: forward and loss under autocast on GPUs
    )
