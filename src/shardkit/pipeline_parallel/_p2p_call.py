"""The machinery behind the public P2P calls of :mod:`.p2p`: argument checks, the refusal
hellos of the check mode, and the fast paths of one static or cached transfer; everything
else is one :func:`._exchange.exchange`.
"""

from __future__ import annotations

import torch

from ..comm import ledger
from ..comm._compat import irecv, isend
from ..comm._group import GroupInfo, resolve_group
from ..comm.checks import checks_enabled
from ..errors import ShardkitError, ShardkitTypeError
from . import _wire
from ._exchange import P2PWork, exchange
from ._packed import PACK_MAX_BYTES, accepted, cached_recv, cached_send, decode_packed, post_packed_at, send_repeat
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
                    _peer(g, towards, loop, api)
    except ShardkitError as exc:
        if checks:  # the peers are waiting for this end's hello: they learn of the error from it
            _refuse(api, groups, sends, recvs, device, loop, exc)
        raise
    single = not checks and not batched and len(groups) == 1 and len(sends) + len(recvs) == 1
    if single and shape is not None:
        work = _static_single(api, groups[0], x, sends or recvs, bool(sends), shape, dtype, device, loop)
        return work if async_op else work.wait()
    if single and shape_cache is not None:
        work = _cached_single(api, groups[0], x, sends or recvs, bool(sends), dtype, device, loop, shape_cache)
        if work is not None:
            return work if async_op else work.wait()
    header = checks or shape is None
    payload = x.detach().contiguous() if sends else None
    transfers = []
    for gi, g in enumerate(groups):
        for towards, phase in sends:
            t = Transfer(
                True, towards, gi, g, _peer(g, towards, loop, api), phase, payload.device, shape, dtype, header, payload
            )
            _check_own_tensor(t, api)
            transfers.append(t)
        for towards, phase in recvs:
            dev = payload.device if payload is not None else _device(device, g, api)
            transfers.append(
                Transfer(False, towards, gi, g, _peer(g, towards, loop, api), phase, dev, shape, dtype, header)
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
        dev = _device(device if isinstance(device, (str, torch.device)) else None, g, api)
        ends = [
            (send, towards, phase, _peer_or_none(g, towards, loop))
            for send, directions in ((True, sends), (False, recvs))
            for towards, phase in directions
        ]
        said = [(s, towards, phase, p, _wire.BAD_ARGUMENTS) for s, towards, phase, p in ends if p is not None]
        if not said and ends and g.size > 1 and not loop:
            s, towards, phase, _ = ends[0]
            other = "prev" if towards == "next" else "next"
            said = [(s, other, phase, _peer(g, other, loop, api), _wire.PAST_END)]
        transfers += [
            Transfer(s, towards, gi, g, p, phase, dev, None, None, True, status=status)
            for s, towards, phase, p, status in said
        ]
    try:
        exchange(transfers, api, False, True, "mean")
    except ShardkitError as agreed:
        raise agreed from cause


class _StaticWork(P2PWork):
    """The :class:`P2PWork` of one transfer without Transfer bookkeeping (:func:`_static_single`,
    :func:`_cached_single`): its c10d works and the received tensor."""

    def __init__(
        self, work, received: torch.Tensor | None
    ) -> None:  # no P2PWork state needed: super().__init__ is not called
        self._works, self._received = [] if work is None else work if isinstance(work, list) else [work], received

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def complete(self) -> None:
        works, self._works = self._works, []
        for w in works:
            w.wait()

    def wait(self) -> torch.Tensor | None:
        self.complete()
        return self._received


def _static_single(api, g: GroupInfo, x, directions, send: bool, shape, dtype, device, loop) -> _StaticWork:
    """One message whose shape (and dtype) both ends declared, checks off: no header, no
    Transfer bookkeeping, one isend or irecv. The general exchange costs ~100 us of Python per
    message here, a third of a 16 KiB gloo transfer; pipelines with static shapes send many."""
    towards, phase = directions[0]
    peer = _peer(g, towards, loop, api)
    if send:
        if tuple(x.shape) != shape or (dtype is not None and x.dtype != dtype):
            raise ShardkitError(
                f"{api}: stage {g.rank} of {g.size} declared {_wire.describe(shape, dtype or x.dtype)} but its tensor "
                f"is {_wire.describe(x.shape, x.dtype)}"
            )
        payload = x.detach().contiguous()
        if payload.numel() == 0:
            return _StaticWork(None, None)
        ledger.record(
            "send", api, phase, g.size, payload.nbytes, 0, pg=g.pg, shape=payload.shape, peer=peer, dtype=payload.dtype
        )
        return _StaticWork(isend(payload, g.pg, peer), None)
    buf = torch.empty(shape, dtype=dtype, device=_device(device, g, api))
    if buf.numel() == 0:
        return _StaticWork(None, buf)
    ledger.record("recv", api, phase, g.size, 0, buf.nbytes, pg=g.pg, shape=buf.shape, peer=peer, dtype=buf.dtype)
    return _StaticWork(irecv(buf, g.pg, peer), buf)


def _cached_single(api, g: GroupInfo, x, directions, send: bool, dtype, device, loop, cache) -> _StaticWork | None:
    """One negotiated transfer whose channel already has a cached shape (checks off, ordered,
    one group): the messages of :func:`._packed.cached_send` / ``cached_recv`` without the
    general exchange's bookkeeping (~100 us of Python a message). None when the channel has no
    cached shape yet: the caller runs the general exchange, which negotiates and fills it."""
    towards, phase = directions[0]
    peer = _peer(g, towards, loop, api)
    cached = cache.lookup(g.pg, send, peer)
    if cached is None:
        return None
    # A repeat of the cached shape (status OK) changes nothing in the cache and needs no
    # Transfer: each step of the general path costs host time on every microbatch.
    if send:
        payload = x.detach().contiguous()
        if (
            payload.dtype == cached.dtype
            and payload.shape == cached.shape
            and payload.device == cached.device
            and (dtype is None or dtype == payload.dtype)
        ):  # the sender's own checks cannot fail: a header described this shape before
            return _StaticWork(send_repeat(g, peer, phase, payload, cached, cache, api), None)
        t = Transfer(True, towards, 0, g, peer, phase, payload.device, None, dtype, True, payload)
        _check_own_tensor(t, api)
        works = cached_send(t, cached, api, cache)
    else:
        where = _device(device, g, api)
        if cached.nbytes <= PACK_MAX_BYTES:
            buf, work = post_packed_at(g, peer, phase, cached, where, api)
            work.wait()
            if (body := accepted(buf, cached, dtype, where)) is not None:
                return _StaticWork(None, body)
        t = Transfer(False, towards, 0, g, peer, phase, where, None, dtype, True)
        if cached.nbytes <= PACK_MAX_BYTES:
            works = decode_packed(t, cached, buf, api)
        else:
            works = cached_recv(t, cached, api)
    if t.status == _wire.OK and t.payload is not None:  # a completed transfer holds its tensor
        cache.put(t, t.payload.shape, t.payload.dtype)
    if t.error is not None:
        for w in works:
            w.wait()  # keep the channel in step, then raise (the peer raises too: the header told it)
        raise t.error
    return _StaticWork(works, None if send else t.payload)


def _resolve_groups(group, api: str) -> list[GroupInfo]:
    if not isinstance(group, (list, tuple)):
        return [resolve_group(group, api)]
    groups = list(group)
    if not groups:
        raise ShardkitTypeError(f"{api}: group is an empty list; pass a pipeline group or a list of them")
    return [resolve_group(g, api) for g in groups]


def _peer_or_none(g: GroupInfo, towards: str, loop: bool) -> int | None:
    """Group rank of the next or previous stage; None past the pipeline's end (or with ``loop``
    in a group of one)."""
    peer = g.rank + (1 if towards == "next" else -1)
    if loop:
        return peer % g.size if g.size > 1 else None
    return peer if 0 <= peer < g.size else None


def _peer(g: GroupInfo, towards: str, loop: bool, api: str) -> int:
    """Group rank of the next or previous stage."""
    peer = _peer_or_none(g, towards, loop)
    if peer is not None:
        return peer
    if loop:
        raise ShardkitError(f"{api}: loop=True needs at least 2 pipeline stages, the group has {g.size}")
    which, other = ("last", "next") if towards == "next" else ("first", "previous")
    raise ShardkitError(
        f"{api}: stage {g.rank} is the {which} of {g.size} pipeline stages and has no {other} stage "
        f"(pass loop=True to connect the last stage to the first)"
    )


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


def _check_own_tensor(t: Transfer, api: str) -> None:
    """The sender's checks of its own tensor: against its declaration, and that a header can
    describe it. The exchange raises them after telling the receiver (or before sending
    anything when no header is sent)."""
    x = t.payload
    assert x is not None  # a sender's transfer carries its tensor
    if (t.shape is not None and tuple(x.shape) != t.shape) or (t.dtype is not None and x.dtype != t.dtype):
        t.status = _wire.BAD_DECLARATION
        t.error = ShardkitError(
            f"{api}: {t.where()} declared {_wire.describe(t.shape, t.dtype or x.dtype)} but its tensor is "
            f"{_wire.describe(x.shape, x.dtype)}"
        )
    elif t.header and (why := _wire.unencodable(x.dtype, x.shape)):
        t.status = _wire.UNENCODABLE
        t.error = ShardkitError(f"{api}: {t.where()} cannot send its tensor with a header: {why}")


def _device(device, g: GroupInfo, api: str) -> torch.device:
    """Receive buffers: the given device, else CPU for gloo, else the current accelerator."""
    if device is not None:
        try:
            return torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ShardkitTypeError(f"{api}: bad device {device!r}: {exc}") from None
    backend = g.pg.name().lower()  # the backend's name, e.g. "gloo" (cheaper than dist.get_backend)
    # check_available: a CUDA build on a machine without a GPU has no current accelerator
    current = torch.accelerator.current_accelerator(check_available=True)
    if backend == "gloo" or current is None:
        return torch.device("cpu")
    return torch.device(current.type, torch.accelerator.current_device_index())
