"""Split/gather pair of the sequence-parallel codebases, with an explicit gradient scale.

These are *not* adjoint pairs under the sum-over-ranks inner product; they are the right
gradient when the tensor on the replicated side is treated as one variable shared by all ranks:

* ``split_forward_gather_backward``: a replicated tensor enters a sharded region. Backward
  gathers the per-rank gradients of the blocks into the (replicated) gradient of the full tensor.
* ``gather_forward_split_backward``: a sharded tensor leaves into a replicated region whose
  downstream gradient is identical on every rank. Backward keeps this rank's block of it.

``grad_scale`` follows the MindSpeed-MM and Open-Sora ops: ``None`` (no scale), ``"up"`` (x R)
or ``"down"`` (/ R). When each is right:

* ``None``: parameters on the replicated side get their gradient counted once, e.g. the whole
  loss is the sum of the per-rank block losses (split), or the loss is computed identically on
  every rank and counted once (gather). Sharded parameters then get exact gradients.
* ``"down"`` on split: the loss is the *mean* of the per-rank losses, typically because the
  parameters' gradients are later averaged over a group that includes these ranks (DDP over
  sequence-parallel ranks); the gathered gradient is R times too large without it.
* ``"up"`` on gather: the replicated loss is counted once per rank and parameter gradients are
  averaged over the group afterwards; each block then needs R times its split gradient.

The adjoint view: with a replicated cotangent, ``split(R x ·)`` is the adjoint of gather and
``gather(· / R)`` the adjoint of split under the sum-over-ranks inner product, which is what
the tests check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _c10d
from ._validate import (
    GRAD_SCALES,
    checking,
    enter,
    expected_size,
    full_dim,
    grad_scale_factor,
    maybe_agree,
    sharded_dim,
)

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Literal

    from .._types import Group

__all__ = ["split_forward_gather_backward", "gather_forward_split_backward"]


def _scale_code(grad_scale) -> int:
    """An int for the cross-rank check: ranks must agree on the gradient scale too."""
    return GRAD_SCALES.index(grad_scale) if grad_scale in GRAD_SCALES else -1


def _scaled(grad: torch.Tensor, factor: float | None) -> torch.Tensor:
    return grad if factor is None else grad * factor


class _SplitForwardGatherBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, dim, sizes, factor):
        ctx.g, ctx.dim, ctx.sizes, ctx.factor = g, dim, sizes, factor
        return _c10d.local_split(x, g, dim, sizes)

    @staticmethod
    def backward(ctx, grad):
        full = _c10d.all_gather(grad, ctx.g, ctx.dim, ctx.sizes, "split_forward_gather_backward", "backward")
        return _scaled(full, ctx.factor), None, None, None, None


class _GatherForwardSplitBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, dim, sizes, factor):
        ctx.g, ctx.dim, ctx.sizes, ctx.factor = g, dim, sizes, factor
        return _c10d.all_gather(x, g, dim, sizes, "gather_forward_split_backward", "forward")

    @staticmethod
    def backward(ctx, grad):
        return _scaled(_c10d.local_block(grad, ctx.g, ctx.dim, ctx.sizes), ctx.factor), None, None, None, None


def split_forward_gather_backward(
    x: torch.Tensor,
    group: Group,
    dim: int,
    sizes: Sequence[int] | None = None,
    grad_scale: Literal["up", "down"] | None = None,
) -> torch.Tensor:
    """Keep this rank's block along ``dim`` in forward; all-gather the gradient in backward.

    Args:
        x: full tensor ``[..., N, ...]``, replicated on every rank.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: dim to split (negative allowed).
        sizes: block sizes summing to ``N``; None for the balanced split.
        grad_scale: None, ``"up"`` (x R) or ``"down"`` (/ R) applied to the gathered gradient;
            see the module docstring for when each is right.

    Returns:
        ``[..., sizes[rank], ...]``, a new contiguous tensor (``x`` itself when ``R == 1``).

    Raises:
        ShardkitError: bad ``dim``/``sizes``/``grad_scale``.
        ShardkitTypeError: ``grad_scale`` on a non-floating tensor; bad types.
        RankMismatchError: (check mode) ranks disagree on shape, dtype or arguments.

    Source: MindSpeed-MM / Open-Sora ``split_forward_gather_backward``.
    """
    op = "split_forward_gather_backward"
    g = enter(x, group, op)
    if checking(g):
        maybe_agree(g, op, x, (dim, sizes, _scale_code(grad_scale)))
    d, sizes = full_dim(x, g, dim, sizes, op)
    factor = grad_scale_factor(grad_scale, x, g, op)
    if g.size == 1:
        return x
    if not (x.requires_grad and torch.is_grad_enabled()):  # no graph to record: skip the Function's bookkeeping
        return _c10d.local_split(x, g, d, sizes)
    return _SplitForwardGatherBackward.apply(x, g, d, sizes, factor)


def gather_forward_split_backward(
    x: torch.Tensor,
    group: Group,
    dim: int,
    sizes: Sequence[int] | None = None,
    grad_scale: Literal["up", "down"] | None = None,
) -> torch.Tensor:
    """All-gather along ``dim`` in forward; keep this rank's block of the gradient in backward.

    Args:
        x: local block ``[..., n_r, ...]``.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: dim to gather (negative allowed).
        sizes: ``n_r`` of every rank (uneven and zero sizes allowed). None learns them with one
            small metadata all-gather (ledger phase ``"metadata"``); pass them to skip it.
        grad_scale: None, ``"up"`` (x R) or ``"down"`` (/ R) applied to the split gradient;
            see the module docstring for when each is right.

    Returns:
        ``[..., sum(sizes), ...]``, identical on every rank.

    Raises:
        As :func:`split_forward_gather_backward`, plus ``sizes[rank]`` != local size.

    Source: MindSpeed-MM / Open-Sora ``gather_forward_split_backward``.
    """
    op = "gather_forward_split_backward"
    g = enter(x, group, op)
    known = None
    if checking(g):
        known = maybe_agree(
            g, op, x, (dim, sizes, _scale_code(grad_scale)), local_dim=dim, expected_local=expected_size(sizes, g.rank)
        )
    d, sizes = sharded_dim(x, g, dim, sizes, op, known)
    factor = grad_scale_factor(grad_scale, x, g, op)
    if g.size == 1:
        return x
    if not (x.requires_grad and torch.is_grad_enabled()):
        return _c10d.all_gather(x, g, d, sizes, op, "forward")
    return _GatherForwardSplitBackward.apply(x, g, d, sizes, factor)
