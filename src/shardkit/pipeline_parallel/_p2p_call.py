"""The machinery behind the public P2P calls of :mod:`.p2p`: argument checks, the refusal
hellos of the check mode, one message through the runner's own transport (:mod:`._links`);
everything else (several messages or groups, batched, hellos) is one :func:`._exchange.exchange`.
"""

from __future__ import annotations

import torch

from ..comm._group import GroupInfo, resolve_group
from ..comm.checks import checks_enabled
from ..errors import ShardkitError, ShardkitTypeError
from . import _wire
from ._exchange import exchange
from ._links import (
    Posted,
    check_own_tensor,
    peer,
    peer_or_none,
    recv_device,
    recv_message,
    send_message,
)
from ._transfer import ShapeCache, Transfer

__all__ = ["run"]


def run(api, group, x, sends, recvs, shape, dtype, device, loop, batched, async_op, reduce, shape_cache=None):
    """Validate (every check here is a function of this rank's arguments and stage, raised
    before any message is posted), build the transfers and run the exchange."""
    groups = _resolve_groups(group, api)
    checks = checks_enabled()
    try:
        shape = _check_arguments(api, x, sends, recvs, shape, dtype, reduce, shape_cache)
        if checks:  # a stage past the pipeline's end: refused too, and said in a hello (see _refuse)
            for g in groups:
                for towards, _ in sends + recvs:
                    peer(g, towards, loop, api)
    except ShardkitError as exc:
        if checks:  # the peers are waiting for this end's hello: they learn of the error from it
            _refuse(api, groups, sends, recvs, device, loop, exc)
        raise
    if not checks and not batched and len(groups) == 1 and len(sends) + len(recvs) == 1:
        work = _single(api, groups[0], x, sends or recvs, bool(sends), shape, dtype, device, loop, shape_cache)
        return work if async_op else work.wait()
    header = checks or shape is None
    payload = x.detach().contiguous() if sends else None
    transfers = []
    for gi, g in enumerate(groups):
        for towards, phase in sends:
            t = Transfer(
                True, towards, gi, g, peer(g, towards, loop, api), phase, payload.device, shape, dtype, header, payload
            )
            check_own_tensor(t, api)
            transfers.append(t)
        for towards, phase in recvs:
            dev = payload.device if payload is not None else recv_device(device, g, api)
            transfers.append(
                Transfer(False, towards, gi, g, peer(g, towards, loop, api), phase, dev, shape, dtype, header)
            )
    work = exchange(transfers, api, bool(batched), checks, reduce, shape_cache)
    return work if async_op else work.wait()


def _check_arguments(api, x, sends, recvs, shape, dtype, reduce, shape_cache):
    """This rank's arguments (a function of them alone); the checked static shape."""
    if sends and not isinstance(x, torch.Tensor):
        raise ShardkitTypeError(f"{api}: expected a torch.Tensor to send, got {type(x).__name__}")
    shape = _check_shape(shape, api)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ShardkitTypeError(f"{api}: dtype must be a torch.dtype, got {dtype!r}")
    if recvs and shape is not None and dtype is None:
        raise ShardkitTypeError(f"{api}: a static receive (shape={list(shape)}) also needs dtype=")
    if reduce not in ("mean", "sum"):
        raise ShardkitError(f"{api}: reduce must be 'mean' or 'sum', got {reduce!r}")
    if shape_cache is not None and not isinstance(shape_cache, ShapeCache):
        raise ShardkitTypeError(f"{api}: shape_cache must be a ShapeCache or None, got {type(shape_cache).__name__}")
    return shape


def _refuse(api, groups, sends, recvs, device, loop, cause: ShardkitError) -> None:
    """Checks on, this call was refused: exchange hellos saying so with every peer it addresses,
    then raise the error both ends raise (this rank's own message as its cause).

    A call that addresses only stages past the pipeline's end (no ``loop``) has no such peer: it
    says hello (status ``PAST_END``, its own role and phase) to the stage on its other side
    instead. That stage is the only one that can be waiting for this call (in a transfer the
    program meant the other way round, as when the last stage receives a gradient from a next
    stage while the previous one sends it an activation); if it makes no P2P call to this stage,
    this stage waits for it like any check-mode transfer waits for its peer (the flight recorder
    names it at the process-group timeout)."""
    transfers = []
    for gi, g in enumerate(groups):
        dev = recv_device(device if isinstance(device, (str, torch.device)) else None, g, api)
        ends = [
            (send, towards, phase, peer_or_none(g, towards, loop))
            for send, directions in ((True, sends), (False, recvs))
            for towards, phase in directions
        ]
        said = [(s, towards, phase, p, _wire.BAD_ARGUMENTS) for s, towards, phase, p in ends if p is not None]
        if not said and ends and g.size > 1 and not loop:
            s, towards, phase, _ = ends[0]
            other = "prev" if towards == "next" else "next"
            said = [(s, other, phase, peer(g, other, loop, api), _wire.PAST_END)]
        transfers += [
            Transfer(s, towards, gi, g, p, phase, dev, None, None, True, status=status)
            for s, towards, phase, p, status in said
        ]
    try:
        exchange(transfers, api, False, True, "mean")
    except ShardkitError as agreed:
        raise agreed from cause


def _single(api, g: GroupInfo, x, directions, send: bool, shape, dtype, device, loop, cache) -> Posted:
    """One message, checks off, ordered: the runner's own transport (:mod:`._links`): one
    ``isend`` / ``irecv`` with a declared shape, else negotiated through ``cache`` (None: a
    header every time). A negotiated receive waits for its header here (it needs the shape)."""
    ((towards, phase),) = directions
    q = peer(g, towards, loop, api)
    if send:
        return Posted(send_message(api, g, towards, q, phase, x, (shape, dtype), cache))
    r = recv_message(api, g, towards, q, phase, (shape, dtype), cache, recv_device(device, g, api), shape is not None)
    works = r.finish()
    if r.t.error is not None:
        Posted(works).complete()
        raise r.t.error
    return Posted(works, r.t.payload)


def _resolve_groups(group, api: str) -> list[GroupInfo]:
    if not isinstance(group, (list, tuple)):
        return [resolve_group(group, api)]
    groups = list(group)
    if not groups:
        raise ShardkitTypeError(f"{api}: group is an empty list; pass a pipeline group or a list of them")
    return [resolve_group(g, api) for g in groups]


def _check_shape(shape, api: str):
    if shape is None:
        return None
    if isinstance(shape, torch.Size):
        return tuple(shape)  # sizes of a real tensor: non-negative ints already
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise ShardkitTypeError(f"{api}: shape must be a sequence of ints, got {shape!r}")
    if any(d < 0 for d in shape):
        raise ShardkitError(f"{api}: shape entries must be >= 0, got {list(shape)}")
    return tuple(shape)
