"""All-to-all over any pair of dims, aligned or not, with one c10d call each way."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._shapes import balanced_split_sizes, normalize_dim
from ..errors import ShardkitError, ShardkitTypeError
from . import _c10d
from ._cache import plan_cache
from ._validate import checking, dim_of, enter, maybe_agree, raise_agreed
from ._validate import gather_sizes as gather_sizes_of

if TYPE_CHECKING:
    from .._types import Group

__all__ = ["all_to_all"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, scatter_dim, gather_dim, scatter_sizes, gather_sizes):
        ctx.g, ctx.scatter_dim, ctx.gather_dim = g, scatter_dim, gather_dim
        ctx.scatter_sizes, ctx.gather_sizes = scatter_sizes, gather_sizes
        return _c10d.all_to_all(x, g, scatter_dim, gather_dim, scatter_sizes, gather_sizes, "all_to_all", "forward")

    @staticmethod
    def backward(ctx, grad):
        # The adjoint of an all-to-all is the reverse all-to-all: scatter what was gathered and
        # gather what was scattered, with the forward's split sizes swapped.
        out = _c10d.all_to_all(
            grad,
            ctx.g,
            ctx.gather_dim,
            ctx.scatter_dim,
            ctx.gather_sizes,
            ctx.scatter_sizes,
            "all_to_all",
            "backward",
        )
        return out, None, None, None, None, None


def all_to_all(
    x: torch.Tensor, group: Group, scatter_dim: int, gather_dim: int, gather_size: int | None = None
) -> torch.Tensor:
    """Scatter ``scatter_dim`` and gather ``gather_dim`` in forward; the reverse all-to-all in backward.

    The Ulysses layout switch: e.g. ``[B, S/R, N, D]`` with ``scatter_dim=2, gather_dim=1`` becomes
    ``[B, S, N/R, D]``. Any pair of distinct dims of any ndim works, aligned or not: the scatter
    dim is split by the balanced rule (:func:`shardkit.balanced_split_sizes`, the first
    ``N % R`` ranks get one more). Along ``gather_dim`` rank ``r`` holds block ``r`` of the
    gathered dim: of the balanced split of ``gather_size`` when it is given (no metadata
    traffic), or of any split (uneven, zero sizes) when it is not: the sizes are then learned
    with one small metadata all-gather (ledger phase ``"metadata"``).

    One ``all_to_all_single`` per forward and per backward, no padding and no list all-to-all:
    each side does at most one layout copy, none when its dim is outermost (all dims before it
    have size 1).

    Args:
        x: local tensor; ``x.shape[scatter_dim]`` (the full size being scattered) and every other
            dim except ``gather_dim`` equal on all ranks.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        scatter_dim: dim to split across ranks.
        gather_dim: dim to concatenate across ranks.
        gather_size: global size of ``gather_dim`` after the gather, whose balanced split the
            ranks hold; None (default) learns every rank's size (one metadata all-gather).

    Returns:
        Tensor with ``scatter_dim`` of size ``balanced_split_sizes(S, R)[rank]`` and ``gather_dim``
        of size ``gather_size`` (the sum of the ranks' sizes when not given).

    Raises:
        ShardkitError: ``scatter_dim == gather_dim``; a dim out of range; ``gather_size`` negative
            or its balanced block for this rank different from the local size.
        ShardkitTypeError: bad types (non-int ``gather_size``, non-tensor ``x``, bad group).
        RankMismatchError: (check mode) dtype, shapes or arguments differ across ranks.

    Source: DeepSpeed-Ulysses (Jacobs et al., 2023) layout switch; MindSpeed-MM's unaligned
    all-to-all semantics, re-implemented as a single uneven ``all_to_all_single``.
    """
    op = "all_to_all"
    g = enter(x, group, op)
    if gather_size is not None and (isinstance(gather_size, bool) or not isinstance(gather_size, int)):
        raise_agreed(g, op, ShardkitTypeError(f"{op}: gather_size must be an int or None, got {gather_size!r}"))
    known = None
    if checking(g):
        expected = None
        if gather_size is not None and gather_size >= 0:
            expected = balanced_split_sizes(gather_size, g.size)[g.rank]
        known = maybe_agree(
            g, op, x, (scatter_dim, gather_dim, gather_size), local_dim=gather_dim, expected_local=expected
        )
    if gather_size is not None and type(scatter_dim) is int and type(gather_dim) is int:
        s, d, scatter_sizes, gather_sizes = _checked(x.shape, scatter_dim, gather_dim, gather_size, g.size, g.rank)
    else:
        s, d = dim_of(x, scatter_dim, op), dim_of(x, gather_dim, op)
        _check_distinct(s, d, x.shape)
        if gather_size is None:
            gather_sizes = gather_sizes_of(x, g, d, op, known)  # learned: any split, zero sizes included
        else:
            gather_sizes = _balanced_gather(gather_size, x.shape[d], d, g.size, g.rank)
        scatter_sizes = balanced_split_sizes(x.shape[s], g.size)
    if g.size == 1:
        return x
    if not (x.requires_grad and torch.is_grad_enabled()):
        # No graph to record (inference, benchmarks, integer metadata): skip the autograd
        # Function's bookkeeping, about a third of the per-call cost at small sizes.
        return _c10d.all_to_all(x, g, s, d, scatter_sizes, gather_sizes, "all_to_all", "forward")
    return _AllToAll.apply(x, g, s, d, scatter_sizes, gather_sizes)


def _check_distinct(s: int, d: int, shape) -> None:
    if s == d:
        raise ShardkitError(
            f"all_to_all: scatter_dim and gather_dim must differ, both are {s} (tensor of shape {tuple(shape)})"
        )


def _balanced_gather(gather_size: int, local: int, d: int, size: int, rank: int) -> list[int]:
    """The balanced split of ``gather_size``, checked against this rank's ``local`` size along ``d``."""
    if gather_size < 0:
        raise ShardkitError(f"all_to_all: gather_size must be >= 0, got {gather_size}")
    sizes = balanced_split_sizes(gather_size, size)
    if sizes[rank] != local:
        raise ShardkitError(
            f"all_to_all: rank {rank} of {size} holds {local} elements along gather_dim {d}, but the balanced "
            f"split of gather_size={gather_size} gives it {sizes[rank]} ({sizes})"
        )
    return sizes


@plan_cache(1024)
def _checked(shape: tuple[int, ...], scatter_dim: int, gather_dim: int, gather_size: int, size: int, rank: int):
    """``(s, d, scatter sizes, gather sizes)`` of a call with ``gather_size`` given, once per
    distinct arguments (plain ints: the key is everything the checks read). A failing check is
    not cached: it raises the same error on every call."""
    s, d = normalize_dim(scatter_dim, len(shape), "all_to_all"), normalize_dim(gather_dim, len(shape), "all_to_all")
    _check_distinct(s, d, shape)
    gather_sizes = tuple(_balanced_gather(gather_size, shape[d], d, size, rank))
    return s, d, tuple(balanced_split_sizes(shape[s], size)), gather_sizes
