"""``global_mean_loss``: the loss to back-propagate when data ranks count different numbers of tokens.

With ``grad_reduce="mean"`` (torch DDP's average) the reduced gradient is the mean over the
``D`` data ranks of the per-rank gradients, so a per-rank token mean (Hugging Face's ``labels=``
loss) gives the global token mean only when every rank counts the same number of tokens.
Padding (``-100`` labels), packed documents or uneven cp parts break that; the global token
mean needs each rank's *sum* of token losses divided by the *global* count ``N``, times ``D`` to
undo the average.

Source: the normalisation of Hugging Face transformers' ``num_items_in_batch`` (the global count,
the loss multiplied by the number of processes before DDP's average) and Megatron-LM's
per-token loss (sum and count reduced over the data-parallel ranks).
"""

from __future__ import annotations

import torch

from .._types import Group
from ..comm import _c10d
from ..comm._group import resolve_group
from ..errors import ShardkitError
from .grads import GradReduce, check_grad_reduce

__all__ = ["global_mean_loss"]


def global_mean_loss(
    loss_sum: torch.Tensor,
    token_count: int | torch.Tensor,
    group: Group | None,
    *,
    grad_reduce: GradReduce = "mean",
) -> torch.Tensor:
    """This rank's loss whose gradient, reduced over the data ranks, is that of the global token mean.

    ``N = sum over the group of token_count`` (one all-reduce of one float64 number, recorded in
    the ledger under ``"global_mean_loss"``); returns ``loss_sum * D / N`` for
    ``grad_reduce="mean"`` (``D`` = the group's size) and ``loss_sum / N`` for ``"sum"``. Summing
    the returned values over the group gives ``D`` times the global mean (``"mean"``), or the
    global mean itself (``"sum"``). ``N = 0`` gives NaN, as the unsharded mean of no tokens does.

    Args:
        loss_sum: 0-d floating tensor, the *sum* of this rank's token losses (e.g.
            ``F.cross_entropy(..., reduction="sum", ignore_index=-100)``), any dtype and device.
        token_count: the number of tokens this rank's ``loss_sum`` counts (an int or a 0-d
            integer or floating tensor), 0 allowed.
        group: the ranks holding different data, ``pm.mesh["dp_cp"]`` of a
            :class:`~shardkit.parallelize.ParallelModel` (a ``ProcessGroup`` or a 1-D
            ``DeviceMesh``); None for one process (``parallelize(model, None)``).
        grad_reduce: the ``grad_reduce`` the model was parallelized with.

    Returns:
        0-d tensor of ``loss_sum``'s dtype, to back-propagate before ``pm.grads.reduce()``.

    Raises:
        ShardkitError: ``loss_sum`` not a 0-d floating tensor, ``token_count`` not a count, or
            ``grad_reduce`` not ``"mean"`` or ``"sum"``.
        ShardkitTypeError: ``group`` not a ``ProcessGroup`` or a 1-D ``DeviceMesh``.
    """
    op = "global_mean_loss"
    mode = check_grad_reduce(grad_reduce, op)
    if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0 or not loss_sum.is_floating_point():
        raise ShardkitError(
            f"{op}: loss_sum must be a 0-d floating tensor, got {getattr(loss_sum, 'shape', loss_sum)!r}"
        )
    if isinstance(token_count, torch.Tensor):
        if token_count.dim() != 0 or token_count.is_complex() or token_count.dtype == torch.bool:
            raise ShardkitError(f"{op}: token_count must be an int or a 0-d real tensor, got shape {token_count.shape}")
        count = token_count.detach().to(device=loss_sum.device, dtype=torch.float64).reshape(1)
    elif isinstance(token_count, int) and not isinstance(token_count, bool) and token_count >= 0:
        count = torch.tensor([float(token_count)], dtype=torch.float64, device=loss_sum.device)
    else:
        raise ShardkitError(f"{op}: token_count must be a non-negative int or a 0-d tensor, got {token_count!r}")
    ranks = 1
    if group is not None:
        info = resolve_group(group, op)
        ranks = info.size
        if ranks > 1:
            count = _c10d.all_reduce(count, info, op, "forward")
    scale = (ranks if mode == "mean" else 1) / count.reshape(())
    return loss_sum * scale.to(loss_sum.dtype)
