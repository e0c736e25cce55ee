"""One stage-boundary transfer between two tp groups: the sending and the receiving side.

Messages of one transfer, in order (see :mod:`.vtp` for the layouts and the piece plan):

1. (dynamic shapes, sharded sender of tp > 1) an all-gather of the senders' local headers in
   the sending stage: every sender learns the full shape and checks the balanced split.
2. (dynamic shapes, or any transfer while ``shardkit.comm.checks`` is on) a header with the
   full shape, dtype and a status: sender leader -> receiver leader, then broadcast in the
   receiving stage; or rank ``i`` -> rank ``i`` for a replicated boundary of equal tp sizes.
   A non-OK status (the sender found its own tensor wrong) means no payload follows, and
   every receiving rank raises.
3. the pieces, each sent directly by the rank that holds it, in ``(src, dst)`` order.
4. (leader mode) the receiving leader broadcasts the full tensor in its stage.

Static transfers (``decl=(shape, dtype)`` on both sides, checks off) send only 3 and 4; a
sender whose tensor does not match its declaration then raises before sending anything, and its
receivers wait (as :mod:`.p2p`). Matching never relies on tags (NCCL FIFO pairing is enough:
between two ranks a transfer's messages are posted in the same order on both ends).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import _c10d, ledger
from ..comm._group import GroupInfo
from ..comm.checks import checks_enabled
from ..errors import RankMismatchError, ShardkitError
from . import _wire
from ._transfer import post_one
from ._wire import HEADER_LEN, OK
from .vtp import Replicate, Shard, leader_mode, local_box, piece_plan

__all__ = ["Side", "send_side", "recv_side"]


class Side:
    """One end of a boundary: the stage's group ranks in the replica group and its layout."""

    def __init__(self, ranks, layout) -> None:
        self.ranks, self.layout, self.size = tuple(ranks), layout, len(ranks)


def _slices(box, origin):
    return tuple(slice(lo - o0, hi - o0) for (lo, hi), (o0, _) in zip(box, origin))


def _header_pairs(src: Side, dst: Side) -> list[tuple[int, int]]:
    if isinstance(src.layout, Replicate) and isinstance(dst.layout, Replicate) and src.size == dst.size:
        return [(i, i) for i in range(src.size)]
    return [(0, 0)]


def _bcast(t: torch.Tensor, tp: GroupInfo, api: str, phase: str) -> None:
    if tp.size > 1:
        ledger.record(
            "broadcast", api, phase, tp.size, t.nbytes if tp.rank == 0 else 0, 0 if tp.rank == 0 else t.nbytes, pg=tp.pg
        )
        dist.broadcast(t, src=dist.get_global_rank(tp.pg, 0), group=tp.pg)


def _recv(t: torch.Tensor, pg: GroupInfo, peer: int, api: str, phase: str) -> torch.Tensor:
    """Receive into ``t`` from group rank ``peer`` (recorded in the ledger), waited; ``t``."""
    post_one(pg, peer, False, t, phase, api).wait()
    return t


def _full_shape(x: torch.Tensor, src: Side, tp: GroupInfo, decl, header: bool, api: str):
    """``(full shape, status, error)`` on a sender; collective in the sending stage only for a
    dynamic sharded boundary (every sender sees every local header, so all agree)."""
    layout = src.layout
    if isinstance(layout, Shard) and layout.dim >= x.dim():
        return (
            tuple(x.shape),
            _wire.UNENCODABLE,
            ShardkitError(f"{api}: the boundary layout is Shard({layout.dim}) but the tensor has {x.dim()} dims"),
        )
    if decl is not None:
        shape, dtype = decl
        want = tuple(hi - lo for lo, hi in local_box(layout, shape, src.size, tp.rank))
        if tuple(x.shape) != want or x.dtype != dtype:
            return (
                tuple(shape),
                _wire.BAD_DECLARATION,
                ShardkitError(
                    f"{api}: tp rank {tp.rank} of the sending stage declared full {_wire.describe(shape, dtype)} "
                    f"(local block {list(want)}) but its tensor is {_wire.describe(x.shape, x.dtype)}"
                ),
            )
        return tuple(shape), OK, None
    if isinstance(layout, Replicate) or src.size == 1:
        return tuple(x.shape), OK, None
    mine = _wire.encode(OK, x.dtype, x.shape, x.device)
    rows = _c10d.all_gather(mine, tp, 0, (HEADER_LEN,) * tp.size, api, "check")
    metas = [_wire.decode(r, api, f"tp rank {k}") for k, r in enumerate(rows.view(tp.size, HEADER_LEN))]
    d = layout.dim
    shape = list(x.shape)
    shape[d] = sum(m.shape[d] if m.shape and len(m.shape) > d else 0 for m in metas)
    for k, m in enumerate(metas):
        want = tuple(hi - lo for lo, hi in local_box(layout, shape, tp.size, k))
        if m.dtype != x.dtype or m.shape != want:
            got = "; ".join(f"tp rank {r}: {_wire.describe(mm.shape, mm.dtype)}" for r, mm in enumerate(metas))
            return (
                tuple(shape),
                _wire.BAD_DECLARATION,
                ShardkitError(
                    f"{api}: the sending stage's blocks are not a balanced Shard({d}) split of one "
                    f"{_wire.describe(shape, x.dtype)} tensor: {got}"
                ),
            )
    return tuple(shape), OK, None


def send_side(x: torch.Tensor, src: Side, dst: Side, pg: GroupInfo, tp: GroupInfo, decl, api: str, phase: str):
    """Post the sends of this rank's part of ``x`` (its local tensor in ``src.layout``); return
    ``(full shape, works)``: the sends are not waited for (the chunked runner waits at the end of
    its call, :mod:`._mailbox`), but for an error, raised once they completed.

    Raises:
        ShardkitError: the local tensors do not form the layout, or do not match ``decl``;
            raised after the header told the receivers (when a header is sent).
    """
    x = x.detach().contiguous()
    header = decl is None or checks_enabled()
    shape, status, error = _full_shape(x, src, tp, decl, header, api)
    if error is not None and not header:
        raise error
    works = []
    if header:
        for i, j in _header_pairs(src, dst):
            if i == tp.rank:
                hdr = _wire.encode(status, x.dtype, shape, x.device)
                works.append(post_one(pg, dst.ranks[j], True, hdr, "check" if decl is not None else phase, api))
    if error is None:
        origin = local_box(src.layout, shape, src.size, tp.rank)
        for p in piece_plan(src.layout, src.size, dst.layout, dst.size, shape):
            if p.src == tp.rank:
                works.append(post_one(pg, dst.ranks[p.dst], True, x[_slices(p.box, origin)].contiguous(), phase, api))
    if error is not None:
        for w in works:
            w.wait()
        raise error
    return shape, works


def recv_side(src: Side, dst: Side, pg: GroupInfo, tp: GroupInfo, decl, device, api: str, phase: str):
    """Receive this rank's part in ``dst.layout``; return ``(local tensor, full shape)``.

    Raises:
        ShardkitError: the sender reported an error (no payload followed).
        RankMismatchError: the header differs from ``decl`` (raised after the payload arrived).
    """
    header = decl is None or checks_enabled()
    error = None
    if header:
        hdr = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        pairs = _header_pairs(src, dst)
        for i, j in pairs:
            if j == tp.rank:
                _recv(hdr, pg, src.ranks[i], api, "check" if decl is not None else phase)
        if len(pairs) == 1:
            _bcast(hdr, tp, api, "check" if decl is not None else phase)
        meta = _wire.decode(hdr, api, f"the sending stage (group ranks {list(src.ranks)})")
        if meta.status != OK:
            raise ShardkitError(
                f"{api}: the sending stage (group ranks {list(src.ranks)}) reported an error with "
                f"its tensor; nothing was sent to the receiving stage (group ranks {list(dst.ranks)})"
            )
        shape, dtype = meta.shape, meta.dtype
        if decl is not None and (tuple(decl[0]) != shape or decl[1] != dtype):
            error = RankMismatchError(
                f"{api}: the receiving stage (group ranks {list(dst.ranks)}) declared "
                f"{_wire.describe(decl[0], decl[1])} but was sent {_wire.describe(shape, dtype)}"
            )
    else:
        shape, dtype = tuple(decl[0]), decl[1]
    lead = leader_mode(src.layout, src.size, dst.layout, dst.size)
    origin = local_box(Replicate() if lead else dst.layout, shape, dst.size, tp.rank)
    out = torch.empty([hi - lo for lo, hi in origin], dtype=dtype, device=device)
    for p in piece_plan(src.layout, src.size, dst.layout, dst.size, shape):
        if p.dst != tp.rank:
            continue
        region = out[_slices(p.box, origin)]
        if region.is_contiguous():
            _recv(region, pg, src.ranks[p.src], api, phase)
        else:
            region.copy_(_recv(torch.empty(region.shape, dtype=dtype, device=device), pg, src.ranks[p.src], api, phase))
    if lead:
        _bcast(out, tp, api, phase)
    if error is not None:
        raise error
    return out, shape
