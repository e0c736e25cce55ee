"""Private c10d helpers: buffer layout and the single c10d call per collective.

Every helper takes already-validated arguments, allocates its own output, never modifies its
input, records itself in the ledger and returns a contiguous tensor.

Layout trick used throughout: a contiguous tensor viewed as ``[A, n, B]`` around the dim of
interest (``A`` = product of the dims before it, ``B`` = after it). Per-rank blocks along that dim
are contiguous in memory exactly when ``A == 1``; then the communication buffer *is* the tensor
and no layout copy is needed. Otherwise one strided ``copy_`` per block packs or unpacks it.
Uneven sizes go through ``all_to_all_single`` with split sizes because gloo rejects uneven list
``all_gather`` (docs/design.md, Platform facts).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from .._shapes import split_offsets
from . import ledger
from ._cache import plan_cache
from ._compat import all_gather_single, reduce_scatter_single
from ._group import GroupInfo


def _with_dim(shape, dim: int, size: int) -> list[int]:
    out = list(shape)
    out[dim] = size
    return out


class _Scratch(threading.local):
    """Per-thread reusable byte buffers for the send and receive buffers a helper packs or
    unpacks and never returns (``slot`` 0 and 1: one call may need both).

    Why: the CPU allocator hands blocks of a few MiB back to the OS when they are freed (glibc
    trims the heap top), so a fresh buffer per call pays a page fault and a zeroed page for
    every 4 KiB it touches: measured on the 2-rank 4 MiB Ulysses layouts, that was as much as
    the layout copy itself. The same buffer per thread costs the faults once. A c10d call on a
    CPU tensor returns when its buffers are free again, so the next call may overwrite them;
    CUDA's caching allocator already recycles blocks (and an NCCL call returns before it has
    read them), so other devices get fresh buffers. Megatron-LM keeps a global memory buffer
    for its sequence-parallel all-gather for the same reason.

    Holds the largest buffer each slot was asked for, for the life of the thread, and the typed
    view it handed out last (a repeated request, every step of a run, costs no new view).
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.views: list[tuple | None] = [None, None]  # (numel, dtype, view of the buffer)


_scratch_buffers = _Scratch()


def _scratch(numel: int, like: torch.Tensor, slot: int) -> torch.Tensor:
    """A flat ``numel``-element buffer of ``like``'s dtype and device whose contents the caller
    uses only until its c10d call returns (see :class:`_Scratch`)."""
    if not like.is_cpu:
        return like.new_empty(numel)
    last = _scratch_buffers.views[slot]
    if last is not None and last[0] == numel and last[1] == like.dtype:
        return last[2]
    nbytes = numel * like.element_size()
    buf = _scratch_buffers.buffers[slot]
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        _scratch_buffers.buffers[slot] = buf
    view = buf[:nbytes].view(like.dtype)
    _scratch_buffers.views[slot] = (numel, like.dtype, view)
    return view


# Uneven splits pack and unpack with one row gather (index_select) when rows (the elements after
# the split dim) are at least this long; below it the int64 index would outweigh the data.
_MIN_ROW = 8


@plan_cache(128)
def _pack_order(a: int, sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Row permutation of a ``[a, n]`` grid of rows that lays out the blocks of ``sizes``
    along ``n`` one after another: packed row k is source row ``order[k]``. Cached per shape:
    a pure function of the sizes, reused every step of a training run."""
    n = sum(sizes)
    rows = torch.arange(a * n).view(a, n)
    return torch.cat([rows[:, off : off + s].reshape(-1) for off, s in zip(split_offsets(sizes), sizes)]).to(device)


@plan_cache(128)
def _unpack_order(a: int, sizes: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Inverse permutation of :func:`_pack_order`."""
    order = _pack_order(a, sizes, torch.device("cpu"))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return inverse.to(device)


def _runs(sizes: Sequence[int]):
    """Group consecutive equal block sizes: yields ``(offset, count, size)``.

    A balanced split has at most two runs whatever R is, so packing costs at most two strided
    copies instead of one per rank.
    """
    off, i = 0, 0
    while i < len(sizes):
        j = i
        while j < len(sizes) and sizes[j] == sizes[i]:
            j += 1
        yield off, j - i, sizes[i]
        off += (j - i) * sizes[i]
        i = j


@plan_cache(1024)
def _run_table(sizes: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """``tuple(_runs(sizes))``, once per distinct sizes."""
    return tuple(_runs(sizes))


def _blocks_view(t: torch.Tensor, dim: int, off: int, count: int, size: int) -> torch.Tensor:
    """``count`` consecutive blocks of ``size`` along ``dim`` of a contiguous ``t``, as ``[count, A, size, B]``."""
    a, n, b = math.prod(t.shape[:dim]), t.shape[dim], math.prod(t.shape[dim + 1 :])
    v = t.view(a, n, b)
    if count * size != n:
        v = v[:, off : off + count * size]
    return v.view(a, count, size, b).transpose(0, 1)


def _pack(x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
    """Flat send buffer holding ``x``'s blocks along ``dim`` one after another (block r =
    sizes[r]): ``x`` itself when they already are, else scratch slot 0 (valid until the next
    pack on this thread: consume it with one c10d call)."""
    if math.prod(x.shape[:dim]) == 1 and x.is_contiguous():
        return x.reshape(-1)  # blocks are already consecutive: no copy
    runs = _run_table(tuple(sizes))
    buf = _scratch(x.numel(), x, 0)
    if x.is_contiguous() and len(runs) == 1:
        # Even split: one permuting copy.
        src = _blocks_view(x, dim, *runs[0])
        buf.view(src.shape).copy_(src)
        return buf
    a, n, b = math.prod(x.shape[:dim]), x.shape[dim], math.prod(x.shape[dim + 1 :])
    if x.is_contiguous() and b >= _MIN_ROW:
        # Uneven split: one row gather with a cached index instead of a copy per run.
        torch.index_select(x.view(a * n, b), 0, _pack_order(a, tuple(sizes), x.device), out=buf.view(a * n, b))
        return buf
    pos = 0
    if x.is_contiguous():
        for run in runs:
            src = _blocks_view(x, dim, *run)
            buf[pos : pos + src.numel()].view(src.shape).copy_(src)
            pos += src.numel()
        return buf
    for off, size in zip(split_offsets(sizes), sizes):  # arbitrary strides: one copy per block
        block = _with_dim(x.shape, dim, size)
        n = math.prod(block)
        buf[pos : pos + n].view(block).copy_(x.narrow(dim, off, size))
        pos += n
    return buf


def _unpack_copies(out_shape, dim: int) -> bool:
    """Whether :func:`_unpack` copies into a new tensor (else it returns a view of its buffer,
    which must then be a fresh allocation, not scratch)."""
    return math.prod(out_shape[:dim]) != 1


def _recv_buffer(numel: int, like: torch.Tensor, out_shape, dim: int) -> torch.Tensor:
    """Receive buffer for a call unpacked along ``dim``: scratch slot 1 when the unpack copies."""
    return _scratch(numel, like, 1) if _unpack_copies(out_shape, dim) else like.new_empty(numel)


def _unpack(buf: torch.Tensor, out_shape: Sequence[int], dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`_pack`: a contiguous ``out_shape`` tensor from blocks along ``dim``."""
    if not _unpack_copies(out_shape, dim):
        return buf.view(out_shape)  # blocks land where they belong: no copy
    # The copies land in a tensor of out_shape, not in a flat one viewed as out_shape: a view
    # returned from a module wrapped by FSDP2 (the gathered logits) makes it warn on every step.
    out = buf.new_empty(out_shape)
    runs = _run_table(tuple(sizes))
    if len(runs) == 1:
        _, count, size = runs[0]
        a, b = math.prod(out_shape[:dim]), math.prod(out_shape[dim + 1 :])
        out.view(a, count, size, b).copy_(buf.view(count, a, size, b).transpose(0, 1))  # one copy
        return out
    a, n, b = math.prod(out_shape[:dim]), out_shape[dim], math.prod(out_shape[dim + 1 :])
    if b >= _MIN_ROW:
        torch.index_select(buf.view(a * n, b), 0, _unpack_order(a, tuple(sizes), buf.device), out=out.view(a * n, b))
        return out
    pos = 0
    for run in runs:
        dst = _blocks_view(out, dim, *run)
        dst.copy_(buf[pos : pos + dst.numel()].view(dst.shape))
        pos += dst.numel()
    return out


def _record(op: str, api: str, phase: str, g: GroupInfo, sent: torch.Tensor, received: torch.Tensor, shape, sizes=None):
    """The ledger entry of one call: its buffers' bytes and the dtype of the data it moves."""
    ledger.record(
        op, api, phase, g.size, sent.nbytes, received.nbytes, pg=g.pg, shape=shape, sizes=sizes, dtype=sent.dtype
    )


def all_reduce(x: torch.Tensor, g: GroupInfo, api: str, phase: str) -> torch.Tensor:
    """Sum of ``x`` over the group, in a new contiguous tensor."""
    out = x.clone(memory_format=torch.contiguous_format)
    _record("all_reduce", api, phase, g, out, out, out.shape)
    dist.all_reduce(out, group=g.pg)
    return out


class _Gather(NamedTuple):
    """What an all-gather of a given shape, dim and sizes needs, computed once (:func:`_gather_plan`)."""

    out_shape: tuple[int, ...]
    blocks: list[int]  # elements received from each rank (c10d takes a list)
    total: int
    even: bool
    in_place: bool  # the blocks land where they belong: receive straight into the returned tensor


@plan_cache(1024)
def _gather_plan(shape: tuple[int, ...], dim: int, sizes: tuple[int, ...]) -> _Gather:
    out_shape = tuple(_with_dim(shape, dim, sum(sizes)))
    blocks = [math.prod(_with_dim(shape, dim, s)) for s in sizes]
    return _Gather(out_shape, blocks, sum(blocks), len(set(sizes)) == 1, not _unpack_copies(out_shape, dim))


def all_gather(x: torch.Tensor, g: GroupInfo, dim: int, sizes, api: str, phase: str) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; rank r contributes ``sizes[r]`` there."""
    p = _gather_plan(x.shape, dim, tuple(sizes))
    src = x.contiguous()
    out = x.new_empty(p.out_shape) if p.in_place else None
    if p.even and out is not None and dim == 0:
        # c10d's own concatenation: no flat views (each costs about a microsecond).
        _record("all_gather_single", api, phase, g, src, out, x.shape, sizes)
        all_gather_single(out, src, group=g.pg)
        return out
    buf = _scratch(p.total, x, 1) if out is None else out.view(-1)
    if p.even:
        _record("all_gather_single", api, phase, g, src, buf, x.shape, sizes)
        all_gather_single(buf, src.view(-1), group=g.pg)
    else:
        # Uneven: send the whole local block to every rank, receive block r from rank r.
        send = src.reshape(-1).repeat(g.size)  # (an expand + reshape of an empty tensor is not contiguous)
        _record("all_to_all_single", api, phase, g, send, buf, x.shape, sizes)
        dist.all_to_all_single(
            buf, send, output_split_sizes=p.blocks, input_split_sizes=[src.numel()] * g.size, group=g.pg
        )
    return out if out is not None else _unpack(buf, list(p.out_shape), dim, sizes)


@plan_cache(1024)
def _scatter_plan(shape: tuple[int, ...], dim: int, sizes: tuple[int, ...], rank: int) -> tuple[bool, tuple[int, ...]]:
    """(whether the split is even, this rank's output shape) of :func:`reduce_scatter`."""
    return len(set(sizes)) == 1, tuple(_with_dim(shape, dim, sizes[rank]))


def reduce_scatter(x: torch.Tensor, g: GroupInfo, dim: int, sizes, api: str, phase: str) -> torch.Tensor:
    """Sum over ranks of block ``rank`` of ``x`` along ``dim`` (block r has ``sizes[r]``)."""
    even, out_shape = _scatter_plan(x.shape, dim, tuple(sizes), g.rank)
    if even and dim == 0 and x.is_contiguous():
        # c10d's own split along dim 0: no pack and no flat views (each costs about a microsecond).
        out = x.new_empty(out_shape)
        _record("reduce_scatter_single", api, phase, g, x, out, x.shape, sizes)
        reduce_scatter_single(out, x, group=g.pg)
        return out
    send = _pack(x, dim, sizes)
    if even:
        out = x.new_empty(out_shape)
        _record("reduce_scatter_single", api, phase, g, send, out, x.shape, sizes)
        reduce_scatter_single(out.view(-1), send, group=g.pg)
        return out
    # Uneven: every rank sends block j to rank j, then sums the R blocks it received. Same
    # traffic as a ring reduce-scatter, and gloo has no uneven reduce-scatter.
    blocks = [math.prod(_with_dim(x.shape, dim, s)) for s in sizes]
    recv = x.new_empty(g.size * blocks[g.rank])
    _record("all_to_all_single", api, phase, g, send, recv, x.shape, sizes)
    dist.all_to_all_single(
        recv, send, output_split_sizes=[blocks[g.rank]] * g.size, input_split_sizes=blocks, group=g.pg
    )
    return recv.view(g.size, *out_shape).sum(0)


def all_to_all(
    x: torch.Tensor,
    g: GroupInfo,
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: list[int],
    gather_sizes: list[int],
    api: str,
    phase: str,
) -> torch.Tensor:
    """Scatter ``scatter_dim`` (block j to rank j), gather ``gather_dim`` (block j from rank j).

    One ``all_to_all_single``; at most one layout copy on each side, none on a side whose dim is
    outermost (all dims before it have size 1).
    """
    p = _a2a_plan(x.shape, scatter_dim, gather_dim, tuple(scatter_sizes), tuple(gather_sizes), g.rank)
    if p.pack_view is not None and x.is_contiguous():
        # Even split of an inner dim: the one permuting copy of _pack, its views read from the plan.
        a, count, size, b = p.pack_view
        send = _scratch(x.numel(), x, 0)
        send.view(count, a, size, b).copy_(x.view(a, count, size, b).transpose(0, 1))
    else:
        send = _pack(x, scatter_dim, scatter_sizes)
    recv = _scratch(p.total, x, 1) if p.unpack_copies else x.new_empty(p.total)
    _record("all_to_all_single", api, phase, g, send, recv, x.shape, gather_sizes)
    dist.all_to_all_single(recv, send, output_split_sizes=p.out_splits, input_split_sizes=p.in_splits, group=g.pg)
    return _unpack(recv, p.out_shape, gather_dim, gather_sizes) if p.unpack_copies else recv.view(p.out_shape)


class _AllToAllPlan(NamedTuple):
    in_splits: tuple[int, ...]  # elements sent to each rank
    out_splits: tuple[int, ...]  # elements received from each rank
    out_shape: tuple[int, ...]
    total: int
    unpack_copies: bool
    pack_view: tuple[int, int, int, int] | None  # [A, count, size, B] of an even inner split, else None


@plan_cache(1024)
def _a2a_plan(
    shape: tuple[int, ...],
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: tuple[int, ...],
    gather_sizes: tuple[int, ...],
    rank: int,
) -> _AllToAllPlan:
    """Split sizes and output shape of :func:`all_to_all`, once per distinct arguments."""
    in_splits = tuple(math.prod(_with_dim(shape, scatter_dim, s)) for s in scatter_sizes)
    local = _with_dim(shape, scatter_dim, scatter_sizes[rank])  # what every source sends to us
    out_splits = tuple(math.prod(_with_dim(local, gather_dim, s)) for s in gather_sizes)
    out_shape = tuple(_with_dim(local, gather_dim, sum(gather_sizes)))
    a, n, b = math.prod(shape[:scatter_dim]), shape[scatter_dim], math.prod(shape[scatter_dim + 1 :])
    even = len(set(scatter_sizes)) == 1
    pack_view = (a, len(scatter_sizes), scatter_sizes[0], b) if even and a != 1 and n else None
    return _AllToAllPlan(
        in_splits, out_splits, out_shape, sum(out_splits), _unpack_copies(out_shape, gather_dim), pack_view
    )


def local_split(x: torch.Tensor, g: GroupInfo, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim``, as a new contiguous tensor (no communication)."""
    off = split_offsets(sizes)[g.rank]
    return x.narrow(dim, off, sizes[g.rank]).clone(memory_format=torch.contiguous_format)


def local_block(x: torch.Tensor, g: GroupInfo, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim``, contiguous: a view of ``x`` when the block is
    already consecutive in memory (no copy), else one copy. For gradients, which nothing
    modifies in place (torch's own ``cat`` backward hands out views of its gradient too)."""
    block = x.narrow(dim, split_offsets(sizes)[g.rank], sizes[g.rank])
    return block if block.is_contiguous() else block.clone(memory_format=torch.contiguous_format)


def all_to_all_flat(
    send: torch.Tensor, in_splits: list[int], out_splits: list[int], g: GroupInfo, api: str, phase: str, shape=None
) -> torch.Tensor:
    """One ``all_to_all_single`` on flat, already packed buffers (element counts per rank).

    For callers that pack their own send buffer in a layout no dim-based helper describes
    (e.g. Ulysses attention sending each rank a different subset of heads). ``shape``: the
    logical local shape, for the flight recorder.
    """
    recv = send.new_empty(sum(out_splits))
    _record("all_to_all_single", api, phase, g, send, recv, shape or send.shape)
    dist.all_to_all_single(recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=g.pg)
    return recv
