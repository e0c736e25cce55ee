"""Sequence parallelism between transformer blocks (Megatron-SP), as forward pre-hooks.

Between blocks each tp rank holds a block of the sequence, ``[B, S_r, H]`` with balanced sizes
of ``S`` (any ``S`` works, zero-size blocks included). Around every tensor-parallel region:

* entry: all-gather along the sequence (forward) / reduce-scatter (backward), before the
  column-parallel matmuls that need the whole sequence;
* exit: the row-parallel matmul's partial sums are reduce-scattered along the sequence
  (forward) / all-gathered (backward).

Norms, residual adds and dropout run on the local block, so their activations are ``1 / R`` of
the replicated layout's. Source: Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), as implemented in Megatron-LM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._shapes import balanced_split_sizes
from ..comm import all_gather, reduce_scatter, split_forward_gather_backward
from ..comm._group import resolve_group
from ..errors import ShardkitError

if TYPE_CHECKING:
    from typing import Any
    from torch import nn
    from .._types import Group

__all__ = ["SequenceSharding"]


def _replace_input(args: tuple, kwargs: dict, name: str, fn):
    """Apply ``fn`` to the module input passed as ``args[0]`` or as keyword ``name``."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if name not in kwargs:
        raise ShardkitError(f"sequence parallel hook: the module got neither a positional input nor {name}=")
    return args, {**kwargs, name: fn(kwargs[name])}


class SequenceSharding:
    """Sequence split sizes of one model's current forward, and the hooks that use them.

    One instance per parallelized model (no globals). :meth:`split_pre_hook` on the first block
    reads the full length ``S`` and fixes the balanced sizes; every later hook of the same
    forward uses them. Backward never reads this object: each autograd Function keeps the sizes
    it ran with.

    Args:
        group: the tp ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: the sequence dim of hidden states (1 for ``[B, S, H]``).
        input_name: keyword under which the hooked modules may receive the hidden states.
    """

    def __init__(self, group: Group, dim: int = 1, input_name: str = "hidden_states") -> None:
        self.group = group
        self.dim = dim
        self.input_name = input_name
        self.world = resolve_group(group, "SequenceSharding").size
        self.sizes: list[int] | None = None

    def _current(self, op: str) -> list[int]:
        if self.sizes is None:
            raise ShardkitError(
                f"SequenceSharding.{op}: no sequence split yet; the first block's split hook must run "
                "before the tensor-parallel regions (was the model called on the full sequence?)"
            )
        return self.sizes

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S, H]`` replicated -> ``[B, S_r, H]``; backward all-gathers the gradient.

        The gathered gradient is the gradient of the replicated input on every rank, so what
        produced it (the embedding) gets an identical, complete gradient on every tp rank.
        """
        self.sizes = balanced_split_sizes(x.shape[self.dim], self.world)
        return split_forward_gather_backward(x, self.group, self.dim, self.sizes)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, S_r, H]`` -> ``[B, S, H]``; backward reduce-scatters the partial gradients."""
        return all_gather(x, self.group, self.dim, self._current("gather"))

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Partial sums ``[B, S, H]`` -> summed block ``[B, S_r, H]``; backward all-gathers."""
        return reduce_scatter(x, self.group, self.dim, self._current("reduce_scatter"))

    def split_pre_hook(self, module: nn.Module, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Forward pre-hook (``with_kwargs=True``) splitting the module's input along the sequence."""
        return _replace_input(args, kwargs, self.input_name, self.split)

    def gather_pre_hook(self, module: nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Forward pre-hook (``with_kwargs=True``) gathering the module's input along the sequence."""
        return _replace_input(args, kwargs, self.input_name, self.gather)
