"""Gather full parameters (or gradients) of a tensor-parallel model back, for checks and saving.

Collective: every rank of every tp group must call these functions on its copy of the model,
in the same order (parameters are visited in ``named_parameters`` order, the same on all ranks).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ShardkitError
from ..sharding import gather_full, shard_spec

__all__ = ["unwrap", "gather_full_state_dict", "gather_full_grads"]


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP (or similar ``.module``) wrapper; ``model`` itself otherwise."""
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def _full(t: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    spec = shard_spec(param)
    t = t.detach()
    if spec is None:
        return t.clone()
    return gather_full(t, spec)


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) copies of every parameter, keyed like the unwrapped model's.

    Sharded parameters are all-gathered along their shard dim by their
    :class:`~shardkit.sharding.ShardSpec` (packed parts put back in order, replicated heads taken once);
    replicated ones are cloned. Returns detached tensors, identical on every tp rank.
    """
    return {name: _full(p, p) for name, p in unwrap(model).named_parameters()}


def gather_full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Full gradients of every parameter (None where ``.grad`` is None on every rank).

    Raises:
        ShardkitError: some parameter's ``.grad`` is None while it is sharded (ranks would
            otherwise disagree on which gathers to run).
    """
    out: dict[str, torch.Tensor | None] = {}
    for name, p in unwrap(model).named_parameters():
        if p.grad is None:
            if shard_spec(p) is not None:
                raise ShardkitError(f"gather_full_grads: sharded parameter {name} has no gradient")
            out[name] = None
        else:
            out[name] = _full(p.grad, p)
    return out
