"""A tiny Hugging Face decoder and its loss, for library tests that parallelize it without the CLI.

The model is the trainer's own (its spec's ``build``, :func:`shardkit.train.model.build_model`: transformers' Llama,
Qwen3-MoE, ... from a config, weights from the seed, float64 kept in float64), at sizes small
enough for a persistent gloo world on two loaded cores. The loss follows the trainer's
convention (src/shardkit/data_parallel/grads.py): every rank back-propagates the sum of its token
losses divided by the *global* token count, so summing over the data ranks gives the mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardkit.train.config import TrainConfig
from shardkit.train.specs import model_spec

SIZES = dict(hidden_size=32, intermediate_size=64, layers=2, heads=4, kv_heads=2, seq_len=8, dtype="float64")

# A small Llama ``config.json`` for the planner's tests (``ModelShape.from_config``,
# ``shardkit plan --config``): read only, never mutated.
TINY_LLAMA_CONFIG = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def tiny_decoder(model: str = "llama", **sizes) -> torch.nn.Module:
    """``model`` ("llama", "moe", ...) at :data:`SIZES` (overridden by ``sizes``), float64, seed 0."""
    return model_spec(model).build(TrainConfig(model=model, **{**SIZES, **sizes}))


def token_ids(batch: int, seq_len: int = SIZES["seq_len"], vocab: int = 256, seed: int = 1) -> torch.Tensor:
    """``[batch, seq_len]`` int64 token ids, the same on every rank."""
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


def loss_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the next-token cross-entropy (float64). ``logits [B, S, V]``, ``ids [B, S]``."""
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).double(), ids[:, 1:].reshape(-1), reduction="sum"
    )


def predicted_tokens(ids: torch.Tensor) -> int:
    """Tokens the loss counts in the global batch ``ids [B, S]``: ``B x (S - 1)``."""
    return ids.shape[0] * (ids.shape[1] - 1)
