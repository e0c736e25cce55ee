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

from ._exchange import P2PWork
from ._p2p_call import run
from ._transfer import ShapeCache

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
    opts = (shape, dtype, None, loop, batched, async_op, "mean", shape_cache)
    return run("send_forward", group, x, [_FWD_OUT], [], *opts)


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
        batched: as :func:`send_forward`.
        async_op: as :func:`send_forward`.
        shape_cache: as :func:`send_forward`.
        reduce: ``"mean"`` or ``"sum"`` of the tensors received from several groups.

    Returns:
        A new tensor (``requires_grad`` False), or a :class:`P2PWork` whose ``wait()`` returns it.

    Raises:
        ShardkitTypeError: ``shape`` without ``dtype``; bad types; ``reduce="mean"`` of integers.
        ShardkitError: this is the first stage and ``loop`` is off; the sender reported an
            error; tensors from several groups differ.
        RankMismatchError: the sender's header differs from the declared ``shape``/``dtype``.
    """
    opts = (shape, dtype, device, loop, batched, async_op, reduce, shape_cache)
    return run("recv_forward", group, None, [], [_FWD_IN], *opts)


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
    opts = (shape, dtype, None, loop, batched, async_op, "mean", shape_cache)
    return run("send_backward", group, grad, [_BWD_OUT], [], *opts)


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
    opts = (shape, dtype, device, loop, batched, async_op, reduce, shape_cache)
    return run("recv_backward", group, None, [], [_BWD_IN], *opts)


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
    opts = (shape, dtype, None, loop, batched, async_op, reduce, shape_cache)
    return run("send_forward_recv_backward", group, x, [_FWD_OUT], [_BWD_IN], *opts)


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
    opts = (shape, dtype, None, loop, batched, async_op, reduce, shape_cache)
    return run("send_backward_recv_forward", group, grad, [_BWD_OUT], [_FWD_IN], *opts)


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
    opts = (shape, dtype, None, loop, batched, async_op, reduce, shape_cache)
    return run("send_forward_recv_forward", group, x, [_FWD_OUT], [_FWD_IN], *opts)


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
    opts = (shape, dtype, None, loop, batched, async_op, reduce, shape_cache)
    return run("send_backward_recv_backward", group, grad, [_BWD_OUT], [_BWD_IN], *opts)
