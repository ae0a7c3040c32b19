"""Hugging Face models built from a config (never a download), as a user's TrainJob holds them."""

from __future__ import annotations

import torch
import transformers
from torch.nn import functional as F

from felactl import TrainJob
from felactl.models.data import CharCorpus


def causal_lm_loss(out, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def llama(depth: int = 2, width: int = 32, seq_len: int = 16) -> TrainJob:
    data = CharCorpus(seq_len)
    config = transformers.LlamaConfig(
        vocab_size=len(data.vocab),
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=depth,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * seq_len,
        use_cache=False,
    )
    return _job(transformers.LlamaForCausalLM, config, data)


def _job(model_class, config, data: CharCorpus) -> TrainJob:
    """``model_class`` built from ``config``, seeded, as a causal LM TrainJob on ``data`` (AdamW)."""
    torch.manual_seed(0)
    return TrainJob(
        model=model_class(config),
        dataset=data,
        loss_fn=causal_lm_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )


def gpt2_with_cache(depth: int = 2, seq_len: int = 16) -> TrainJob:
    """GPT-2 as its config builds it by default, to generate: its forward returns a key/value cache."""
    data = CharCorpus(seq_len)
    config = transformers.GPT2Config(vocab_size=len(data.vocab), n_embd=32, n_layer=depth, n_head=4, n_positions=32)
    return TrainJob(model=transformers.GPT2LMHeadModel(config), dataset=data, loss_fn=causal_lm_loss)


def gpt2(depth: int = 2, seq_len: int = 16) -> TrainJob:
    """GPT-2 built to train (no key/value cache, no dropout: runs that differ by a random stream
    would not compare): learned positions, its head tied to the token embedding."""
    data = CharCorpus(seq_len)
    config = transformers.GPT2Config(
        vocab_size=len(data.vocab),
        n_embd=32,
        n_layer=depth,
        n_head=4,
        n_positions=2 * seq_len,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return _job(transformers.GPT2LMHeadModel, config, data)
