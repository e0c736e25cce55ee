"""Point-to-point transfers between adjacent pipeline stages, with shape and dtype negotiation.

The stage is the rank in the pipeline group passed in (``R`` stages): the next stage is group
rank ``+ 1``, the previous one ``- 1``. Without ``loop`` the first stage has no previous stage
and the last none next; with ``loop=True`` the last stage feeds the first (the "end stage" of
MindSpeed-MM layerwise disaggregated training; looped/zero-bubble schedules).

Messages. By default a transfer negotiates: a 160-byte int64 header with dtype and shape (any
ndim up to 16) goes first and the receiver allocates from it, so every microbatch may have its
own shape and dtype (2 messages). Declaring ``shape=`` (and ``dtype=``) on *both* ends makes it
static: one message, the payload, into a buffer allocated from the declaration. Both ends must
agree on static vs dynamic: with checks off a disagreement is a protocol error.

Negotiating once per distinct shape: pass the same :class:`ShapeCache` to every transfer of a
run on every rank (e.g. one per ``run_schedule`` call). Each channel then remembers the last
negotiated shape on both ends, identically, and a repeated shape costs no round trip: the
receiver posts the header and payload receives together (details in :mod:`._exchange`).

Checks (``shardkit.comm.checks(True)`` or ``SHARDKIT_CHECKS=1``): before any payload, both ends
of every transfer exchange a *hello* (:mod:`._wire`): the sender's header, or the receiver's
declaration, plus each end's role, phase and api. Both ends then decide alike: two stages that
both send to each other, both wait to receive, or a forward message meeting a backward receive
(``loop``) raise the same :class:`~shardkit.errors.RankMismatchError` on both ends, nothing
transferred and the channel clean; a receiver declaring another shape or dtype than the sender's
tensor, a sender whose tensor does not match its own declaration, or a call whose own arguments
are refused (it still says hello, its own message kept as the cause) raises the same text on
both ends, at the call, with no payload sent, instead of corrupting data or hanging. A call past
the pipeline's end (without ``loop``: the first stage receiving a forward or sending a backward
message, the last stage the reverse) has no peer there: it says hello to the stage on its other
side, the only one that can be facing it, and both raise the same text. 2 messages each way per
transfer (hello, payload), and the call returns only once the peer has posted its side. With
checks off the sender still checks its own tensor against its declaration and raises before
sending anything (its receiver then waits), and a call past the end raises before any message.
A misuse between stages that do not face each other (stage 1 sends forward while stage 2
receives from stage 3) leaves each waiting on another peer: the flight recorder names it.

Several groups (a stage with several previous or next stages): pass a list of groups. A send
goes to the next (previous) stage of every group; a receive gets one tensor per group and
returns their mean (``reduce="mean"``, float32 accumulation for 16-bit dtypes, as MindSpeed-MM's
multi-group receive) or sum (``reduce="sum"``).

Gradients. These are plain transfers, not autograd Functions: the schedule calls backward and
moves gradients explicitly, as in Megatron-LM. The pairs are adjoint under the sum-over-ranks
inner product: ``send_forward``/``recv_forward`` move ``x`` from stage s to s + 1 (A), and
``send_backward``/``recv_backward`` move ``y`` from s + 1 to s (``A^T``). For several groups,
the fan-out send (the same tensor to every group) is adjoint to ``reduce="sum"``, and
``reduce="mean"`` over ``K`` groups is adjoint to sending ``y / K`` back; sending the unscaled
``y`` back (as MindSpeed-MM does) treats the ``K`` senders as replicas of one variable whose
full gradient each replica holds (the convention of :mod:`shardkit.comm.regions`).

Ordering and modes (details in :mod:`._exchange`): no tags are used, and a fixed even/odd
stage order keeps pp=2 (prev == next with ``loop``) and every other size deadlock-free. Default
(ordered): individual ``isend``/``irecv``, transfer by transfer; a combined call may face either
the mirror combined call or the two single calls on its peer. ``batched=True``: each phase
(headers or hellos, then payloads) is one ``batch_isend_irecv`` per group (with NCCL, the first call
on a group must include all its ranks, as for every ``batch_isend_irecv``); with dynamic shapes
a combined call must then face the mirror combined call, as in Megatron's schedules.
``async_op=True`` returns a :class:`P2PWork`; with dynamic shapes the receiver still waits for
the header inside the call (it needs the shape to post the payload receive), so fully
asynchronous receives need static shapes. Both ends must use the same check mode.

Source: Megatron-LM ``p2p_communication`` (send/recv pairs, even/odd ordering, shape
negotiation); MindSpeed-MM P2P (multi-group averaging, end-stage loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..comm import ledger
from ..comm._compat import irecv, isend
from ..comm._group import GroupInfo, resolve_group
from ..comm.checks import checks_enabled
from ..errors import ShardkitError, ShardkitTypeError
from . import _wire
from ._exchange import P2PWork, ShapeCache, Transfer, cached_recv, cached_send, exchange

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Literal

    from .._types import Group

__all__ = [
    "P2PWork",
    "ShapeCache",
    "send_forward",
    "recv_forward",
    "send_backward",
    "recv_backward",
    "send_forward_recv_backward",
    "send_backward_recv_forward",
    "send_forward_recv_forward",
    "send_backward_recv_backward",
]

_FWD_OUT, _FWD_IN = ("next", "forward"), ("prev", "forward")  # (towards, ledger phase)
_BWD_OUT, _BWD_IN = ("prev", "backward"), ("next", "backward")


def send_forward(
    x: torch.Tensor,
    group: Group | list[Group] | tuple[Group, ...],
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    loop: bool = False,
    batched: bool = False,
    async_op: bool = False,
    shape_cache: ShapeCache | None = None,
) -> P2PWork | None:
    """Send an activation to the next stage (forward); its adjoint is :func:`recv_backward`.

    Args:
        x: the activation, any shape and dtype (e.g. ``[B, S, H]``); sent contiguous and
            detached. With ``async_op`` do not modify it before ``wait()``.
        group: the pipeline group: a ``ProcessGroup``, a 1-D ``DeviceMesh``, or a list of them
            (fan-out: the same tensor to the next stage of each).
        shape: declare the transfer static, with ``dtype`` (the receiver declares the same);
            ``x`` is checked against them.
        dtype: the declared dtype of a static transfer.
        loop: the last stage sends to the first.
        batched: post with ``batch_isend_irecv`` instead of ordered ``isend``/``irecv``.
        async_op: return a :class:`P2PWork` instead of waiting.
        shape_cache: a :class:`ShapeCache` shared by every transfer of one run (each rank makes
            one at the same point): a negotiated transfer whose shape repeats then posts its
            header and payload together (ordered mode, checks off); the receiver passes one too.

    Returns:
        None, or a :class:`P2PWork` whose ``wait()`` returns None.

    Raises:
        ShardkitTypeError: ``x`` not a tensor; bad ``group``/``shape``/``dtype`` types.
        ShardkitError: this is the last stage and ``loop`` is off; ``x`` does not match the
            declared ``shape``/``dtype``; the header cannot describe ``x`` (ndim > 16).
        RankMismatchError: (checks on) the receiver declared a different shape or dtype.
    """
    return _run(
        "send_forward", group, x, [_FWD_OUT], [], shape, dtype, None, loop, batched, async_op, "mean", shape_cache
    )


def recv_forward(
    group: Group | list[Group] | tuple[Group, ...],
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | int | None = None,
    loop: bool = False,
    batched: bool = False,
    async_op: bool = False,
    reduce: Literal["mean", "sum"] = "mean",
    shape_cache: ShapeCache | None = None,
) -> torch.Tensor | P2PWork:
    """Receive an activation from the previous stage (forward); adjoint of :func:`send_backward`.

    Args:
        group: the pipeline group, or a list of groups (one tensor from each, reduced).
        shape: the declared static shape (a static receive needs ``dtype`` too); None for a
            negotiated (dynamic) transfer.
        dtype: the declared dtype; alone, it is checked against the header.
        device: where to allocate; default CPU for a gloo group, else the current accelerator.
        loop: the first stage receives from the last.
        batched, async_op, shape_cache: as :func:`send_forward`.
        reduce: ``"mean"`` or ``"sum"`` of the tensors received from several groups.

    Returns:
        A new tensor (``requires_grad`` False), or a :class:`P2PWork` whose ``wait()`` returns it.

    Raises:
        ShardkitTypeError: ``shape`` without ``dtype``; bad types; ``reduce="mean"`` of integers.
        ShardkitError: this is the first stage and ``loop`` is off; the sender reported an
            error; tensors from several groups differ.
        RankMismatchError: the sender's header differs from the declared ``shape``/``dtype``.
    """
    return _run(
        "recv_forward", group, None, [], [_FWD_IN], shape, dtype, device, loop, batched, async_op, reduce, shape_cache
    )


def send_backward(
    grad: torch.Tensor,
    group: Group | list[Group] | tuple[Group, ...],
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    loop: bool = False,
    batched: bool = False,
    async_op: bool = False,
    shape_cache: ShapeCache | None = None,
) -> P2PWork | None:
    """Send the gradient of a stage's input to the previous stage; adjoint of :func:`recv_forward`.

    Arguments, returns and errors as :func:`send_forward` (this is the first stage and ``loop``
    is off: ShardkitError). With several groups, pass ``grad / K`` to be the exact adjoint of
    ``recv_forward(reduce="mean")`` over ``K`` groups (see the module docstring).
    """
    return _run(
        "send_backward", group, grad, [_BWD_OUT], [], shape, dtype, None, loop, batched, async_op, "mean", shape_cache
    )


def recv_backward(
    group: Group | list[Group] | tuple[Group, ...],
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | int | None = None,
    loop: bool = False,
    batched: bool = False,
    async_op: bool = False,
    reduce: Literal["mean", "sum"] = "mean",
    shape_cache: ShapeCache | None = None,
) -> torch.Tensor | P2PWork:
    """Receive the gradient of this stage's output from the next stage; adjoint of
    :func:`send_forward`.

    Arguments, returns and errors as :func:`recv_forward` (this is the last stage and ``loop``
    is off: ShardkitError). Use ``reduce="sum"`` after a fan-out :func:`send_forward` to several
    groups: the gradient of a tensor used by several next stages is the sum of theirs.
    """
    return _run(
        "recv_backward", group, None, [], [_BWD_IN], shape, dtype, device, loop, batched, async_op, reduce, shape_cache
    )


def send_forward_recv_backward(
    x: torch.Tensor,
    group: Group | list[Group] | tuple[Group, ...],
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    loop: bool = False,
    batched: bool = False,
    async_op: bool = False,
    reduce: Literal["mean", "sum"] = "mean",
    shape_cache: ShapeCache | None = None,
) -> torch.Tensor | P2PWork:
    """Send an activation to the next stage and receive the gradient of an output from it (1F1B steady state).

    ``shape``/``dtype`` declare both tensors (an activation and its gradient share them); the
    received tensor is allocated on ``x``'s device. Otherwise as :func:`send_forward` and
    :func:`recv_backward` together; both directions are posted before waiting.
    """
    return _run(
        "send_forward_recv_backward",
        group,
        x,
        [_FWD_OUT],
        [_BWD_IN],
        shape,
        dtype,
        None,
        loop,
        batched,
        async_op,
        reduce,
        shape_cache,
    )


def send_backward_recv_forward(
    grad: torch.Tensor,
    group: Group | list[Group] | tuple[Group, ...],
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    loop: bool = False,
    batched: bool = False,
    async_op: bool = False,
    reduce: Literal["mean", "sum"] = "mean",
    shape_cache: ShapeCache | None = None,
) -> torch.Tensor | P2PWork:
    """Send an input gradient to the previous stage and receive the next activation from it (1F1B steady state).

    As :func:`send_forward_recv_backward`, directions reversed.
    """
    return _run(
        "send_backward_recv_forward",
        group,
        grad,
        [_BWD_OUT],
        [_FWD_IN],
        shape,
        dtype,
        None,
        loop,
        batched,
        async_op,
        reduce,
        shape_cache,
    )


def send_forward_recv_forward(
    x: torch.Tensor,
    group: Group | list[Group] | tuple[Group, ...],
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    loop: bool = False,
    batched: bool = False,
    async_op: bool = False,
    reduce: Literal["mean", "sum"] = "mean",
    shape_cache: ShapeCache | None = None,
) -> torch.Tensor | P2PWork:
    """Send an activation to the next stage and receive one from the previous stage (a forward shift).

    With ``loop=True`` every stage does both: a ring shift by one stage. Otherwise as
    :func:`send_forward_recv_backward`.
    """
    return _run(
        "send_forward_recv_forward",
        group,
        x,
        [_FWD_OUT],
        [_FWD_IN],
        shape,
        dtype,
        None,
        loop,
        batched,
        async_op,
        reduce,
        shape_cache,
    )


def send_backward_recv_backward(
    grad: torch.Tensor,
    group: Group | list[Group] | tuple[Group, ...],
    *,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    loop: bool = False,
    batched: bool = False,
    async_op: bool = False,
    reduce: Literal["mean", "sum"] = "mean",
    shape_cache: ShapeCache | None = None,
) -> torch.Tensor | P2PWork:
    """Send a gradient to the previous stage and receive one from the next stage (a backward shift)."""
    return _run(
        "send_backward_recv_backward",
        group,
        grad,
        [_BWD_OUT],
        [_BWD_IN],
        shape,
        dtype,
        None,
        loop,
        batched,
        async_op,
        reduce,
        shape_cache,
    )


def _run(api, group, x, sends, recvs, shape, dtype, device, loop, batched, async_op, reduce, shape_cache=None):
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
        ledger.record("send", api, phase, g.size, payload.nbytes, 0, pg=g.pg, shape=payload.shape, peer=peer)
        return _StaticWork(isend(payload, g.pg, peer), None)
    buf = torch.empty(shape, dtype=dtype, device=_device(device, g, api))
    if buf.numel() == 0:
        return _StaticWork(None, buf)
    ledger.record("recv", api, phase, g.size, 0, buf.nbytes, pg=g.pg, shape=buf.shape, peer=peer)
    return _StaticWork(irecv(buf, g.pg, peer), buf)


def _cached_single(api, g: GroupInfo, x, directions, send: bool, dtype, device, loop, cache) -> _StaticWork | None:
    """One negotiated transfer whose channel already has a cached shape (checks off, ordered,
    one group): the messages of :func:`._exchange.cached_send` / ``cached_recv`` without the
    general exchange's bookkeeping (~100 us of Python a message). None when the channel has no
    cached shape yet: the caller runs the general exchange, which negotiates and fills it."""
    towards, phase = directions[0]
    peer = _peer(g, towards, loop, api)
    payload = x.detach().contiguous() if send else None
    where = payload.device if payload is not None else _device(device, g, api)
    t = Transfer(send, towards, 0, g, peer, phase, where, None, dtype, True, payload)
    cached = cache.get(t)
    if cached is None:
        return None
    if send:
        _check_own_tensor(t, api)
    works = (cached_send if send else cached_recv)(t, cached, api)
    if t.status == _wire.OK and t.payload is not None:  # a completed transfer holds its tensor
        cache.put(t, t.payload.shape, t.payload.dtype)
    if t.error is not None:
        for w in works:
            w.wait()  # keep the channel in step, then raise (the peer raises too: the header told it)
        raise t.error
    return _StaticWork(works, None if send else t.payload)


def _resolve_groups(group, api: str) -> list[GroupInfo]:
    groups = list(group) if isinstance(group, (list, tuple)) else [group]
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
    accelerator = getattr(torch, "accelerator", None)
    if backend == "gloo" or accelerator is None or accelerator.current_accelerator() is None:
        return torch.device("cpu")
    return torch.device(accelerator.current_accelerator().type, accelerator.current_device_index())
