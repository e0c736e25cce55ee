"""The pipeline tests' model: a float64 stack of ``Linear(H, H) -> Tanh`` layers, cut into chunks."""

from __future__ import annotations

import torch
from torch import nn

from shardkit.pipeline_parallel import chunk_layers


def tanh_mlp(width: int, layers: int, seed: int) -> nn.Sequential:
    """``layers`` x (``Linear(width, width)``, ``Tanh``) in float64, initialized from ``seed``."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width, dtype=torch.float64), nn.Tanh()]
    return nn.Sequential(*mods)


def mlp_chunks(model: nn.Sequential, layers: int, p: int, v: int, placement: str, r: int) -> list[nn.Sequential]:
    """Rank ``r``'s chunks of a :func:`tanh_mlp` (``chunk_layers``' cut, two modules per layer)."""
    return [nn.Sequential(*list(model)[2 * k.start : 2 * k.stop]) for k in chunk_layers(layers, p, v, placement, r)]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error: the pipeline tests' loss."""
    return ((out - target) ** 2).mean()
