"""Halo exchange along one sharded dim, as one ``all_to_all_single`` each way.

Every rank sends every other rank exactly the elements that rank needs (split sizes from a plan
all ranks compute identically, :mod:`._plan`), so:

* it is correct at ``R = 2``, where the left and the right neighbour are the same rank, without
  P2P tags (NCCL ignores tags and pairs same-peer messages in FIFO order, docs/design.md, Platform facts);
* halos wider than a neighbour's shard come from further ranks, and zero-size shards need no
  special case: they own no piece of anyone's request;
* the backward is the adjoint: received halo gradients travel back in the reverse
  ``all_to_all_single`` and are added into their owners' elements.

One call whatever ``R`` and however far a halo reaches. On NCCL, ``all_to_all_single`` with
split sizes is itself a group of send/recv calls per peer; a batched P2P path that only
addresses the peers with traffic could later run the same plan (the plan fixes the order, so it
would not need tags either).

:func:`post_forward` / :func:`post_backward` start the same two exchanges with ``async_op=True``
and hand back what is needed to finish them (:class:`Posted`, :class:`PostedGrad`), so that the
overlapped convolution (:mod:`._overlap`) computes while the halos travel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .._shapes import split_offsets
from ..comm import ledger
from ..comm._group import GroupInfo
from ..comm._validate import checking, enter, expected_size, maybe_agree, sharded_dim
from ..errors import ShardkitError, ShardkitTypeError
from ._plan import Plan, build_plan

if TYPE_CHECKING:
    from .._types import Group

__all__ = ["halo_exchange", "exchange", "plan_for", "post_forward", "post_backward", "Posted", "PostedGrad"]


def _with_dim(shape, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


def _a2a(
    send: torch.Tensor,
    recv_counts: list[int],
    send_counts: list[int],
    g: GroupInfo,
    api: str,
    phase: str,
    async_op: bool = False,
):
    """One ``all_to_all_single``; returns ``(recv, work)`` (``work`` None unless ``async_op``)."""
    recv = send.new_empty(sum(recv_counts))
    ledger.record("all_to_all_single", api, phase, g.size, send.nbytes, recv.nbytes, pg=g.pg, shape=send.shape)
    work = dist.all_to_all_single(
        recv, send, output_split_sizes=recv_counts, input_split_sizes=send_counts, group=g.pg, async_op=async_op
    )
    return recv, work


class Posted:
    """A forward exchange in flight (or done): ``assemble`` builds any range of the request.

    ``x`` is the local block, ``recv`` the receive buffer (None without traffic). The send
    buffer is kept alive until :meth:`wait` (the collective may still read it).
    """

    def __init__(self, x, g: GroupInfo, dim: int, plan: Plan, recv=None, work=None, send=None) -> None:
        self.x, self.g, self.dim, self.plan = x, g, dim, plan
        self.recv, self.work, self._send = recv, work, send
        self.total = sum(p.out_len for p in plan.pieces[g.rank])

    def wait(self) -> Posted:
        if self.work is not None:
            self.work.wait()
            self.work, self._send = None, None
        return self

    def assemble(self, lo: int, hi: int) -> torch.Tensor:
        """Positions ``[lo, hi)`` of this rank's request (0 = its first requested element), a new
        tensor; local pieces come from ``x``, remote ones from the receive buffer (wait first)."""
        x, dim, r = self.x, self.dim, self.g.rank
        off, slab = self.plan.offsets[r], math.prod(_with_dim(x.shape, dim, 1))
        cursor = [c * slab for c in split_offsets(self.plan.counts[r])]
        parts, pos = [], 0
        for p in self.plan.pieces[r]:
            a, b = max(lo, pos), min(hi, pos + p.out_len)
            if p.owner >= 0 and p.owner != r:
                n = p.length * slab
                src = self.recv[cursor[p.owner] : cursor[p.owner] + n] if b > a else None
                cursor[p.owner] += n
            if b > a:
                if p.mode == "zero":
                    part = x.new_zeros(_with_dim(x.shape, dim, b - a))
                else:
                    if p.owner == r:
                        part = x.narrow(dim, p.start - off, p.length)
                    else:
                        assert src is not None  # set above whenever b > a and the piece is remote
                        part = src.view(_with_dim(x.shape, dim, p.length))
                    if p.mode == "flip":
                        part = part.flip(dim)
                    elif p.mode == "repeat":
                        part = part.expand(_with_dim(x.shape, dim, p.out_len))
                    part = part.narrow(dim, a - pos, b - a)
                parts.append(part)
            pos += p.out_len
        if not parts:
            return x.new_empty(_with_dim(x.shape, dim, 0))
        return torch.cat(parts, dim)


def post_forward(x: torch.Tensor, g: GroupInfo, dim: int, plan: Plan, api: str, async_op: bool = False) -> Posted:
    """Pack and start the forward exchange of ``plan`` (asynchronously with ``async_op``)."""
    r, R = g.rank, g.size
    if not plan.traffic:
        return Posted(x, g, dim, plan)
    off = plan.offsets[r]
    slab = math.prod(_with_dim(x.shape, dim, 1))  # elements per unit length along dim
    # Pack, per destination q in rank order, the pieces of q's request this rank owns.
    send = x.new_empty(sum(plan.counts[q][r] for q in range(R)) * slab)
    pos = 0
    for q in range(R):
        for p in plan.pieces[q] if q != r else ():
            if p.owner == r:
                n = p.length * slab
                send[pos : pos + n].view(_with_dim(x.shape, dim, p.length)).copy_(
                    x.narrow(dim, p.start - off, p.length)
                )
                pos += n
    recv, work = _a2a(
        send,
        [c * slab for c in plan.counts[r]],
        [plan.counts[q][r] * slab for q in range(R)],
        g,
        api,
        "forward",
        async_op,
    )
    return Posted(x, g, dim, plan, recv, work, send)


def _forward(x: torch.Tensor, g: GroupInfo, dim: int, plan: Plan, api: str) -> torch.Tensor:
    posted = post_forward(x, g, dim, plan, api)
    return posted.assemble(0, posted.total)


class PostedGrad:
    """A backward (reverse) exchange in flight: :meth:`finish` adds the received halo gradients."""

    def __init__(self, g: GroupInfo, dim: int, plan: Plan, recv=None, work=None, send=None) -> None:
        self.g, self.dim, self.plan, self.recv, self.work, self._send = g, dim, plan, recv, work, send

    def finish(self, gx: torch.Tensor) -> torch.Tensor:
        """Wait, then add the gradients other ranks computed for this rank's elements into ``gx``."""
        if self.recv is None:
            return gx
        if self.work is not None:
            self.work.wait()
        r, R, dim, plan = self.g.rank, self.g.size, self.dim, self.plan
        off, pos = plan.offsets[r], 0
        for q in range(R):
            for p in plan.pieces[q] if q != r else ():
                if p.owner == r:
                    n = p.length * math.prod(_with_dim(gx.shape, dim, 1))
                    gx.narrow(dim, p.start - off, p.length).add_(
                        self.recv[pos : pos + n].view(_with_dim(gx.shape, dim, p.length))
                    )
                    pos += n
        self.recv = self.work = self._send = None
        return gx


def post_backward(
    chunks, gx: torch.Tensor, g: GroupInfo, dim: int, plan: Plan, api: str, async_op: bool = False
) -> PostedGrad:
    """Start the reverse exchange of request gradients given as ``chunks``.

    ``chunks``: ``(lo, grad)`` pairs, ``grad`` the gradient of request positions
    ``[lo, lo + grad.shape[dim])``; chunks may overlap (their gradients add) and positions no
    chunk covers have zero gradient. Gradients of this rank's own pieces are added into ``gx``
    (the local block's gradient) now; the others are sent to their owners, which add them in
    :meth:`PostedGrad.finish`.
    """
    r, R = g.rank, g.size
    off, shape = plan.offsets[r], gx.shape
    outgoing: list[list[torch.Tensor]] = [[] for _ in range(R)]
    pos = 0
    for p in plan.pieces[r]:
        start, pos = pos, pos + p.out_len
        if p.mode == "zero":
            continue
        covering = [(c_lo, c) for c_lo, c in chunks if c_lo < pos and start < c_lo + c.shape[dim]]
        if len(covering) == 1 and covering[0][0] <= start and pos <= covering[0][0] + covering[0][1].shape[dim]:
            part = covering[0][1].narrow(dim, start - covering[0][0], p.out_len)
        else:
            part = gx.new_zeros(_with_dim(shape, dim, p.out_len))
            for c_lo, c in covering:
                a, b = max(start, c_lo), min(pos, c_lo + c.shape[dim])
                part.narrow(dim, a - start, b - a).add_(c.narrow(dim, a - c_lo, b - a))
        if p.mode == "flip":
            part = part.flip(dim)
        elif p.mode == "repeat":
            part = part.sum(dim, keepdim=True)  # adjoint of broadcasting one element
        if p.owner == r:
            gx.narrow(dim, p.start - off, p.length).add_(part)
        else:
            outgoing[p.owner].append(part)
    if not plan.traffic:
        return PostedGrad(g, dim, plan)
    # Reverse of the forward: send back to each source, in request order, what it sent us.
    slab = math.prod(_with_dim(shape, dim, 1))
    send = gx.new_empty(sum(plan.counts[r]) * slab)
    pos = 0
    for parts in outgoing:
        for part in parts:
            n = part.numel()
            send[pos : pos + n].view(part.shape).copy_(part)
            pos += n
    recv, work = _a2a(
        send,
        [plan.counts[q][r] * slab for q in range(R)],
        [c * slab for c in plan.counts[r]],
        g,
        api,
        "backward",
        async_op,
    )
    return PostedGrad(g, dim, plan, recv, work, send)


def _backward(grad: torch.Tensor, shape, g: GroupInfo, dim: int, plan: Plan, api: str) -> torch.Tensor:
    gx = grad.new_zeros(shape)
    return post_backward([(0, grad)], gx, g, dim, plan, api).finish(gx)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, dim, plan, api):
        ctx.g, ctx.dim, ctx.plan, ctx.api, ctx.shape = g, dim, plan, api, x.shape
        return _forward(x, g, dim, plan, api)

    @staticmethod
    def backward(ctx, grad):
        return _backward(grad, ctx.shape, ctx.g, ctx.dim, ctx.plan, ctx.api), None, None, None, None


def exchange(x: torch.Tensor, g: GroupInfo, dim: int, plan: Plan, api: str) -> torch.Tensor:
    """Run a plan on validated arguments: this rank's requested range along ``dim``.

    Collective whenever ``plan.traffic`` (in forward, and in backward when ``x`` needs a grad).
    """
    mine = plan.pieces[g.rank]
    if not plan.traffic and len(mine) == 1 and mine[0].mode == "copy":
        # Only a slice of the own shard, and no rank needs anything (pointwise or patchify
        # convolutions): a view, no copy and no collective on any rank.
        return x.narrow(dim, mine[0].start - plan.offsets[g.rank], mine[0].length)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Exchange.apply(x, g, dim, plan, api)
    return _forward(x, g, dim, plan, api)


def plan_for(op: str, sizes, ranges, mode: str) -> Plan:
    """:func:`._plan.build_plan`, with ``op`` named in its errors."""
    try:
        return build_plan(tuple(sizes), tuple(ranges), mode)
    except ShardkitError as exc:
        raise ShardkitError(f"{op}: {exc}") from None


def _halo_widths(value, R: int, name: str) -> list[int]:
    if type(value) is int and value >= 0:  # the common case, valid as it is
        return [value] * R
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value] * R
    if (
        isinstance(value, (str, bytes))
        or not isinstance(value, Sequence)
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise ShardkitTypeError(f"halo_exchange: {name} must be an int or a sequence of {R} ints, got {value!r}")
    if len(value) != R or any(v < 0 for v in value):
        raise ShardkitError(f"halo_exchange: {name} must be >= 0 (an int or one per rank of {R}), got {list(value)}")
    return list(value)


def halo_exchange(
    x: torch.Tensor,
    group: Group,
    dim: int,
    left: int | Sequence[int],
    right: int | Sequence[int],
    *,
    sizes: Sequence[int] | None = None,
    periodic: bool = False,
) -> torch.Tensor:
    """Halo exchange along ``dim`` in forward; the reverse exchange with add in backward (its adjoint).

    Rank ``r`` holds the global elements ``[off_r, off_r + n_r)`` of a dim of size
    ``N = sum(sizes)`` and receives the ``left`` elements before its shard and the ``right``
    elements after it, from however many ranks hold them.

    Args:
        x: local block ``[..., n_r, ...]`` with ``n_r`` at ``dim``; other dims equal on all ranks.
        group: a ``ProcessGroup`` or 1-D ``DeviceMesh`` of ``R`` ranks.
        dim: the sharded dim (negative allowed).
        left: halo width before the shard: an int, or one int per rank (>= 0).
        right: halo width after the shard: an int, or one int per rank (>= 0).
        sizes: ``n_r`` of every rank (uneven and zero sizes allowed). None learns them with one
            small metadata all-gather (ledger phase ``"metadata"``); pass them to skip it.
        periodic: wrap around the global dim (position ``q`` reads ``q mod N``, as often as
            needed); otherwise positions outside ``[0, N)`` are zeros.

    Returns:
        ``[..., left_r + n_r + right_r, ...]``: ``[left halo | local | right halo]``, always
        exactly that long; without ``periodic``, the parts beyond the global borders are zeros
        (the zero padding of a convolution). ``x`` itself when every halo is 0.

    Raises:
        ShardkitError: ``dim`` out of range, bad ``sizes`` or widths, ``periodic`` over an
            empty global dim with a non-zero halo.
        ShardkitTypeError, GroupMembershipError, RankMismatchError: as :func:`shardkit.all_gather`.

    Communication: one ``all_to_all_single`` in forward and one in backward (none when no rank
    needs a remote element, e.g. on a size-1 group, where halos are zeros or the periodic wrap
    of ``x`` itself). Source: halo (ghost-cell) exchange of domain-decomposed stencil codes.
    """
    op = "halo_exchange"
    g = enter(x, group, op)
    known = None
    if checking(g):
        known = maybe_agree(
            g,
            op,
            x,
            (dim, int(periodic), sizes, left, right),
            local_dim=dim,
            expected_local=expected_size(sizes, g.rank),
        )
    d, sizes = sharded_dim(x, g, dim, sizes, op, known)  # checked once per shape and sizes
    lefts, rights = _halo_widths(left, g.size, "left"), _halo_widths(right, g.size, "right")
    if not any(lefts) and not any(rights):
        return x
    plan = _halo_plan(tuple(sizes), tuple(lefts), tuple(rights), "circular" if periodic else "zeros")
    return exchange(x, g, d, plan, op)


@functools.lru_cache(maxsize=256)
def _halo_plan(sizes: tuple[int, ...], lefts: tuple[int, ...], rights: tuple[int, ...], mode: str) -> Plan:
    """The plan of a halo request, once per distinct widths and sizes (a failing plan raises every call)."""
    ranges = tuple((o - lw, o + n + rw) for o, n, lw, rw in zip(split_offsets(sizes), sizes, lefts, rights))
    return plan_for("halo_exchange", sizes, ranges, mode)
