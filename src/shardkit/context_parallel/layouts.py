"""Zigzag and packed-sequence layouts of context parallelism, with exact backward.

The layout rules (chunk sizes for any length, packed documents) are in
:mod:`shardkit.context_parallel._sizes`. A zigzag sequence is a packed sequence of one
document, so both layouts share three autograd Functions; they differ only in the permutation
between the global order and the rank-order concatenation of the local parts.

Gradient conventions, as in :mod:`shardkit.comm.regions` and :mod:`shardkit.comm.collectives`:

* ``*_split``: a replicated tensor enters the sharded layout; backward all-gathers the per-rank
  gradients into the gradient of the full tensor (``grad_scale`` as in
  :func:`shardkit.split_forward_gather_backward`).
* ``*_gather``: the sharded tensor leaves into a replicated region whose downstream gradient is
  the same on every rank; backward keeps this rank's part of it (no communication).
* ``*_all_gather``: gather whose backward is its adjoint, a reduce-scatter in zigzag order;
  right when each rank back-propagates its own partial gradient of the gathered tensor.

Source: Megatron-LM's load-balanced context-parallel split, as used by MindSpeed-MM
(``load_balanced_split_forward_gather_backward`` and the packed-data split/gather ops), extended
to any length and to per-document zigzag.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..comm import _c10d
from ..comm._group import GroupInfo
from ..comm._validate import dim_of, enter, grad_scale_factor, maybe_agree
from ..errors import ShardkitError
from ._sizes import _order, check_cu_seqlens, packed_local_cu_seqlens

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Literal

    from .._types import Group

__all__ = ["zigzag_split", "zigzag_gather", "zigzag_all_gather", "packed_split", "packed_gather", "packed_all_gather"]

_SCALES = (None, "up", "down")


def _scaled(grad: torch.Tensor, factor: float | None) -> torch.Tensor:
    return grad if factor is None else grad * factor


class _LayoutSplit(torch.autograd.Function):
    """Keep this rank's tokens (forward); all-gather and un-permute the gradient (backward)."""

    @staticmethod
    def forward(ctx, x, g: GroupInfo, dim, order, factor, api):
        ctx.g, ctx.dim, ctx.order, ctx.factor, ctx.api = g, dim, order, factor, api
        return x.index_select(dim, order.local(g.rank))

    @staticmethod
    def backward(ctx, grad):
        gathered = _c10d.all_gather(grad, ctx.g, ctx.dim, list(ctx.order.sizes), ctx.api, "backward")
        return _scaled(gathered.index_select(ctx.dim, ctx.order.inverse), ctx.factor), None, None, None, None, None


class _LayoutGather(torch.autograd.Function):
    """All-gather and un-permute (forward); keep this rank's tokens of the gradient (backward)."""

    @staticmethod
    def forward(ctx, x, g: GroupInfo, dim, order, factor, api):
        ctx.g, ctx.dim, ctx.order, ctx.factor = g, dim, order, factor
        gathered = _c10d.all_gather(x, g, dim, list(order.sizes), api, "forward")
        return gathered.index_select(dim, order.inverse)

    @staticmethod
    def backward(ctx, grad):
        return (
            _scaled(grad.index_select(ctx.dim, ctx.order.local(ctx.g.rank)), ctx.factor),
            None,
            None,
            None,
            None,
            None,
        )


class _LayoutAllGather(torch.autograd.Function):
    """All-gather and un-permute (forward); permute and reduce-scatter the gradient (backward)."""

    @staticmethod
    def forward(ctx, x, g: GroupInfo, dim, order, api):
        ctx.g, ctx.dim, ctx.order, ctx.api = g, dim, order, api
        gathered = _c10d.all_gather(x, g, dim, list(order.sizes), api, "forward")
        return gathered.index_select(dim, order.inverse)

    @staticmethod
    def backward(ctx, grad):
        rank_order = grad.index_select(ctx.dim, ctx.order.perm)
        out = _c10d.reduce_scatter(rank_order, ctx.g, ctx.dim, list(ctx.order.sizes), ctx.api, "backward")
        return out, None, None, None, None


def _scale_code(grad_scale) -> int:
    return _SCALES.index(grad_scale) if grad_scale in _SCALES else -1


def _split(x, group, dim, cu_seqlens, grad_scale, op):
    """Shared body of the split functions; ``cu_seqlens`` is None for zigzag (one document of ``S``).

    Returns the local tensor, the resolved group and the validated ``cu_seqlens``.
    """
    g = enter(x, group, op)
    d = dim_of(x, dim, op)
    cu = check_cu_seqlens((0, x.shape[d]) if cu_seqlens is None else cu_seqlens, op, total=x.shape[d])
    maybe_agree(g, op, x, (d, _scale_code(grad_scale), cu))
    factor = grad_scale_factor(grad_scale, x, g, op)
    if g.size == 1:
        return x, g, cu
    return _LayoutSplit.apply(x, g, d, _order(cu, g.size, x.device), factor, op), g, cu


def _gather(x, group, dim, cu, grad_scale, op, adjoint):
    """Shared body of the gather functions; ``adjoint`` picks the reduce-scatter backward."""
    g = enter(x, group, op)
    cu = check_cu_seqlens(cu, op)
    order = _order(cu, g.size, x.device)
    # Every entry of cu_seqlens, not only the per-rank sizes it implies: two packings with the same
    # sizes (an interior boundary moved) would otherwise gather into a silently wrong order.
    maybe_agree(g, op, x, (dim, _scale_code(grad_scale), cu), local_dim=dim, expected_local=order.sizes[g.rank])
    d = dim_of(x, dim, op)
    factor = None if adjoint else grad_scale_factor(grad_scale, x, g, op)
    if x.shape[d] != order.sizes[g.rank]:
        raise ShardkitError(
            f"{op}: rank {g.rank} of {g.size} holds {x.shape[d]} tokens along dim {d}, but the zigzag layout of "
            f"{cu[-1]} tokens ({len(cu) - 1} document(s)) gives it {order.sizes[g.rank]} "
            f"(per rank: {list(order.sizes)})"
        )
    if g.size == 1:
        return x
    if adjoint:
        return _LayoutAllGather.apply(x, g, d, order, op)
    return _LayoutGather.apply(x, g, d, order, factor, op)


def _check_seq_len(seq_len, op: str) -> None:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ShardkitError(f"{op}: seq_len must be an int >= 0, got {seq_len!r}")


def zigzag_split(
    x: torch.Tensor, group: Group, dim: int, grad_scale: Literal["up", "down"] | None = None
) -> torch.Tensor:
    """Keep this rank's zigzag part along ``dim`` in forward; all-gather the gradient in backward.

    Rank ``r`` keeps chunks ``r`` and ``2R - 1 - r`` of ``2R`` balanced chunks (any length; see
    :func:`zigzag_chunk_sizes`).

    Args:
        x: full tensor ``[..., S, ...]``, replicated on every rank.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: the sequence dim (negative allowed).
        grad_scale: None, ``"up"`` (x R) or ``"down"`` (/ R) on the gathered gradient, with the
            meaning of :func:`shardkit.split_forward_gather_backward`.

    Returns:
        ``[..., zigzag_local_sizes(S, R)[rank], ...]``, a new contiguous tensor (``x`` when ``R == 1``).

    Raises:
        ShardkitError: bad ``dim`` or ``grad_scale``.
        ShardkitTypeError: bad types or group.
        RankMismatchError: (check mode) ranks disagree on shape, dtype or arguments.
    """
    return _split(x, group, dim, None, grad_scale, "zigzag_split")[0]


def zigzag_gather(
    x_local: torch.Tensor, group: Group, dim: int, seq_len: int, grad_scale: Literal["up", "down"] | None = None
) -> torch.Tensor:
    """All-gather the zigzag parts along ``dim`` in forward; keep this rank's part of the gradient in backward.

    Use when the gathered tensor feeds a replicated computation whose gradient is the same on
    every rank (use :func:`zigzag_all_gather` when each rank holds a partial gradient).

    Args:
        x_local: ``[..., zigzag_local_sizes(S, R)[rank], ...]``.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: the sequence dim (negative allowed).
        seq_len: the global length ``S``.
        grad_scale: None, ``"up"`` or ``"down"`` on the split gradient, with the meaning of
            :func:`shardkit.gather_forward_split_backward`.

    Returns:
        ``[..., S, ...]`` in global token order, identical on every rank.

    Raises:
        ShardkitError: bad ``dim``/``seq_len``/``grad_scale``; the local size differs from the
            zigzag size of this rank.
        ShardkitTypeError, RankMismatchError: as :func:`zigzag_split`.
    """
    _check_seq_len(seq_len, "zigzag_gather")
    return _gather(x_local, group, dim, (0, seq_len), grad_scale, "zigzag_gather", adjoint=False)


def zigzag_all_gather(x_local: torch.Tensor, group: Group, dim: int, seq_len: int) -> torch.Tensor:
    """All-gather the zigzag parts along ``dim`` in forward; reduce-scatter in zigzag order in backward (its adjoint).

    Args and raises as :func:`zigzag_gather` (no ``grad_scale``: the adjoint needs none).
    """
    _check_seq_len(seq_len, "zigzag_all_gather")
    return _gather(x_local, group, dim, (0, seq_len), None, "zigzag_all_gather", adjoint=True)


def packed_split(
    x: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    group: Group,
    dim: int,
    grad_scale: Literal["up", "down"] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | list[int]]:
    """Keep this rank's zigzag part of every packed document in forward; all-gather the gradient in backward.

    Each document ``d`` (tokens ``cu_seqlens[d]:cu_seqlens[d + 1]``) is split zigzag on its own
    (documents shorter than ``2R`` leave some ranks without tokens of it); the local tensor is
    the concatenation of this rank's parts, in document order.

    Args:
        x: packed tensor ``[..., T, ...]`` with ``T = cu_seqlens[-1]``, replicated on every rank.
        cu_seqlens: ``[num_docs + 1]`` cumulative lengths (ints or a 1-D integer tensor),
            identical on every rank.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: the sequence dim (negative allowed).
        grad_scale: as :func:`zigzag_split`.

    Returns:
        ``(x_local, cu_seqlens_local)``: ``[..., T_r, ...]`` and the local cumulative lengths
        (``num_docs + 1`` entries; a tensor of the input's dtype and device if ``cu_seqlens`` is
        a tensor, else a list).

    Raises:
        ShardkitError: malformed ``cu_seqlens`` or not ending at ``T``; bad ``dim``/``grad_scale``.
        ShardkitTypeError, RankMismatchError: as :func:`zigzag_split`.
    """
    op = "packed_split"
    x_local, g, cu = _split(x, group, dim, cu_seqlens, grad_scale, op)
    local = packed_local_cu_seqlens(cu, g.size, g.rank)
    if isinstance(cu_seqlens, torch.Tensor):
        return x_local, torch.tensor(local, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    return x_local, local


def packed_gather(
    x_local: torch.Tensor,
    cu_seqlens: Sequence[int] | torch.Tensor,
    group: Group,
    dim: int,
    grad_scale: Literal["up", "down"] | None = None,
) -> torch.Tensor:
    """Rebuild the packed tensor from every rank's zigzag parts in forward.

    Backward keeps this rank's part of the gradient.

    Args:
        x_local: ``[..., T_r, ...]`` as returned by :func:`packed_split`.
        cu_seqlens: the *global* cumulative lengths, identical on every rank.
        group: as :func:`zigzag_gather`.
        dim: as :func:`zigzag_gather`.
        grad_scale: as :func:`zigzag_gather`.

    Returns:
        ``[..., cu_seqlens[-1], ...]`` in packed (global) order, identical on every rank.

    Raises:
        As :func:`zigzag_gather`.
    """
    return _gather(x_local, group, dim, cu_seqlens, grad_scale, "packed_gather", adjoint=False)


def packed_all_gather(
    x_local: torch.Tensor, cu_seqlens: Sequence[int] | torch.Tensor, group: Group, dim: int
) -> torch.Tensor:
    """Rebuild the packed tensor in forward; reduce-scatter in packed-zigzag order in backward (its adjoint).

    Args and raises as :func:`packed_gather` (no ``grad_scale``).
    """
    return _gather(x_local, group, dim, cu_seqlens, None, "packed_all_gather", adjoint=True)
