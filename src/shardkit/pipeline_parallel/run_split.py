"""Microbatches of a batch for :func:`~.runner.run_schedule` (views along the batch dimension)."""

from __future__ import annotations

import torch

from ..errors import ShardkitError

__all__ = ["split_microbatches"]


def split_microbatches(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """Split ``[B, ...]`` into ``M`` microbatches ``[B / M, ...]`` along dim 0 (views).

    Raises:
        ShardkitError: ``M`` not an int >= 1, ``batch`` 0-d, or ``M`` does not divide ``B``.
    """
    M = num_microbatches
    if not isinstance(M, int) or isinstance(M, bool) or M < 1:
        raise ShardkitError(f"split_microbatches: num_microbatches must be an int >= 1, got {M!r}")
    if not isinstance(batch, torch.Tensor) or batch.dim() == 0:
        raise ShardkitError("split_microbatches: batch must be a tensor with a batch dimension (dim 0)")
    B = batch.shape[0]
    if B % M:
        raise ShardkitError(
            f"split_microbatches: {M} microbatches do not divide the batch of {B} "
            f"(B % M = {B % M}); pick M dividing {B}"
        )
    return list(batch.split(B // M, dim=0))
