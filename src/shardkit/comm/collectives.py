"""Differentiable collectives: all-reduce (f/g), all-gather and reduce-scatter with exact adjoints.

Each public function validates its arguments, returns its input unchanged on a size-1 group
(identity forward and backward) and otherwise applies one autograd Function whose backward is
the adjoint of its forward under the inner product summed over ranks,
``sum_r <A x, y>_r == sum_r <x, A^T y>_r``. That adjoint is the exact gradient when each rank
back-propagates its own (partial) downstream gradient, the convention of Megatron-LM and
PyTorch functional collectives.

The host path is kept short (issue 24, ``shardkit bench --cases host_overhead``): the check mode's
agreement is only prepared when it is on, dims and sizes are checked once per shape
(:func:`._validate.sharded_dim`), and without a graph to record (no input requiring grad, or
grad mode off) the c10d helper is called directly: ``Function.apply`` would return the same
tensor after a few microseconds of bookkeeping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import _c10d
from ._validate import checking, enter, expected_size, full_dim, maybe_agree, sharded_dim

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["all_reduce_forward", "all_reduce_backward", "all_gather", "reduce_scatter"]


class _AllReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        return _c10d.all_reduce(x, g, "all_reduce_forward", "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x

    @staticmethod
    def backward(ctx, grad):
        return _c10d.all_reduce(grad, ctx.g, "all_reduce_backward", "backward"), None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, dim, sizes):
        ctx.g, ctx.dim, ctx.sizes = g, dim, sizes
        return _c10d.all_gather(x, g, dim, sizes, "all_gather", "forward")

    @staticmethod
    def backward(ctx, grad):
        return _c10d.reduce_scatter(grad, ctx.g, ctx.dim, ctx.sizes, "all_gather", "backward"), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, dim, sizes):
        ctx.g, ctx.dim, ctx.sizes = g, dim, sizes
        return _c10d.reduce_scatter(x, g, dim, sizes, "reduce_scatter", "forward")

    @staticmethod
    def backward(ctx, grad):
        return _c10d.all_gather(grad, ctx.g, ctx.dim, ctx.sizes, "reduce_scatter", "backward"), None, None, None


def all_reduce_forward(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce (sum) in forward; identity in backward. Megatron's ``g`` (reduce from the TP region).

    Use it where each rank holds a partial sum (a row-parallel matmul) and the result is consumed
    identically on every rank: the downstream gradient is replicated, so it passes through.

    Args:
        x: any shape, identical on every rank.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.

    Returns:
        A new tensor, the sum of ``x`` over the group (``x`` itself when ``R == 1``).

    Raises:
        ShardkitTypeError: ``x`` is not a tensor or ``group`` is not a group.
        GroupMembershipError: this rank is not in ``group``.
        RankMismatchError: (check mode) shapes or dtypes differ across ranks.
    """
    g = enter(x, group, "all_reduce_forward")
    if checking(g):
        maybe_agree(g, "all_reduce_forward", x)
    if g.size == 1:
        return x
    if not _records_graph(x):
        return _c10d.all_reduce(x, g, "all_reduce_forward", "forward")
    return _AllReduceForward.apply(x, g)


def all_reduce_backward(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity in forward; all-reduce (sum) in backward. Megatron's ``f`` (copy to the TP region).

    Use it where a replicated input enters a tensor-parallel region whose ranks each produce a
    partial gradient (a column-parallel matmul): the input gradient is their sum.

    Args:
        x: any shape, replicated on every rank.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.

    Returns:
        ``x`` (same values); its gradient is summed over the group in backward.

    Raises:
        ShardkitTypeError, GroupMembershipError, RankMismatchError: as :func:`all_reduce_forward`.
    """
    g = enter(x, group, "all_reduce_backward")
    if checking(g):
        maybe_agree(g, "all_reduce_backward", x)
    return x if g.size == 1 or not _records_graph(x) else _AllReduceBackward.apply(x, g)


def all_gather(x: torch.Tensor, group: Group, dim: int, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """All-gather along ``dim`` in forward; reduce-scatter in backward (its adjoint).

    Args:
        x: local block ``[..., n_r, ...]`` with ``n_r`` at ``dim``; other dims equal on all ranks.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: dim to concatenate along (negative allowed).
        sizes: ``n_r`` of every rank (uneven and zero sizes allowed). None learns them with one
            small metadata all-gather (ledger phase ``"metadata"``); pass them to skip it.

    Returns:
        ``[..., sum(sizes), ...]`` on every rank, blocks in rank order.

    Raises:
        ShardkitError: ``dim`` out of range; ``sizes`` of wrong length, negative, or with
            ``sizes[rank]`` different from the local size.
        ShardkitTypeError: ``x`` not a tensor, bad ``group``, non-int sizes.
        RankMismatchError: (check mode) dtype / other dims / sizes differ across ranks.

    Uneven gathers use ``all_to_all_single`` with split sizes: gloo rejects uneven list
    ``all_gather`` and it costs the same as an even gather (docs/design.md, Platform facts).
    """
    g = enter(x, group, "all_gather")
    known = None
    if checking(g):
        known = maybe_agree(
            g, "all_gather", x, (dim, sizes), local_dim=dim, expected_local=expected_size(sizes, g.rank)
        )
    d, sizes = sharded_dim(x, g, dim, sizes, "all_gather", known)
    if g.size == 1:
        return x
    if not _records_graph(x):
        return _c10d.all_gather(x, g, d, sizes, "all_gather", "forward")
    return _AllGather.apply(x, g, d, sizes)


def reduce_scatter(x: torch.Tensor, group: Group, dim: int, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Reduce-scatter (sum) along ``dim`` in forward; all-gather in backward (its adjoint).

    Args:
        x: full-size partial sums ``[..., N, ...]``, same shape on every rank.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: dim to scatter (negative allowed).
        sizes: block sizes per rank summing to ``N``; None for the balanced split
            (:func:`shardkit.balanced_split_sizes`).

    Returns:
        ``[..., sizes[rank], ...]``: the sum over ranks of this rank's block.

    Raises:
        ShardkitError: ``dim`` out of range; ``sizes`` of wrong length, negative or not summing to ``N``.
        ShardkitTypeError, GroupMembershipError, RankMismatchError: as :func:`all_gather`.

    Even sizes use ``reduce_scatter_single``; uneven ones an ``all_to_all_single`` followed by a
    local sum (same traffic as a ring reduce-scatter).
    """
    g = enter(x, group, "reduce_scatter")
    if checking(g):
        maybe_agree(g, "reduce_scatter", x, (dim, sizes))
    d, sizes = full_dim(x, g, dim, sizes, "reduce_scatter")
    if g.size == 1:
        return x
    if not _records_graph(x):
        return _c10d.reduce_scatter(x, g, d, sizes, "reduce_scatter", "forward")
    return _ReduceScatter.apply(x, g, d, sizes)


def _records_graph(x: torch.Tensor) -> bool:
    """Whether autograd would record an op on ``x`` (else its Function is pure bookkeeping)."""
    return x.requires_grad and torch.is_grad_enabled()
