"""Small shared helpers of the sharded layers: split-size inference and graph-keeping empties."""

from __future__ import annotations

import torch

from ..comm._validate import gather_sizes  # re-exported: the layers' size inference is the ops' own
from ..errors import ShardkitError

__all__ = ["gather_sizes", "keep_graph_empty"]


def keep_graph_empty(shape, *deps: torch.Tensor) -> torch.Tensor:
    """A zero-size result that still depends on ``deps`` in autograd.

    A rank with no outputs must still run the backward collectives of its inputs (the other
    ranks wait for it), so its empty output is tied to them with a zero-weighted sum.
    """
    base = deps[0].new_zeros(shape)
    tie = sum(d.sum() * 0 for d in deps if d.requires_grad)
    return base + tie if isinstance(tie, torch.Tensor) else base


def channels_first(x: torch.Tensor, d: int, nd: int, channels_last: bool, dim, op: str) -> tuple[torch.Tensor, int]:
    """Check that normalized dim ``d`` is a spatial dim of ``x``; return ``x`` as channels-first
    ``[B, C, *S]`` (a view) and the sharded dim's index in that view.

    Raises:
        ShardkitError: ``d`` is the batch or channel dim.
    """
    spatial = list(range(1, nd + 1)) if channels_last else list(range(2, nd + 2))
    if d not in spatial:
        layout = "channels-last" if channels_last else "channels-first"
        raise ShardkitError(
            f"{op}: dim {dim} is not a spatial dim of a {layout} {nd + 2}-d input (spatial dims {spatial})"
        )
    return (x.movedim(-1, 1), d + 1) if channels_last else (x, d)
