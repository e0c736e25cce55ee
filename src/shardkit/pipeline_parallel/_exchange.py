"""The P2P engine: an exchange of a few transfers between adjacent stages.

An exchange is what one public call does: some transfers (send or receive, towards the next or
the previous stage, one per pipeline group). A transfer is a header (dynamic shapes; see
:mod:`._wire`) and the payload (none for zero elements or after a sender error). With checks on,
the header is replaced by a hello each way (sender's header out, receiver's declaration back,
both with the author's role and phase), exchanged and checked on both ends before the payload.

Matching never relies on tags: NCCL ignores them and pairs the messages between two ranks in
FIFO order. Transfers are posted in one fixed order of four slots, by the parity of the stage
(the Megatron-LM order):

    even stage: send next, recv prev, send prev, recv next
    odd stage:  recv prev, send next, recv next, send prev

Two modes:

* ordered (default): transfer by transfer in slot order, each complete before the next (a
  receiver waits for its header, then posts the payload receive). A transfer behaves as one
  message, so a combined call (send + receive) may face the two single calls on the peer.
* batched: one ``batch_isend_irecv`` per group and phase, phases in order: all headers or
  hellos (waited: receivers need the shapes), then all payloads. With dynamic shapes a combined call
  then waits for its peer's header before posting its own payload, so its peer must make the
  mirror combined call (as Megatron's schedules do); with static shapes there is one phase.

Negotiating once per distinct shape (ordered mode, checks off, a :class:`ShapeCache` passed by
the caller): each transfer is a send or receive of :mod:`._packed`, the one way every message is
sent (the runner's too); the cache and its packed messages are described there. On gloo, a
combined call's packed cached receive is read only after the call's later messages are posted
(see :func:`_ordered`).

Why it is safe. (a) Each even/odd pair of neighbours has one side sending first and the other
receiving first, so with blocking (rendezvous) semantics, the worst case of NCCL, every exchange
completes. (b) Towards one peer, "next" traffic is posted before "prev" traffic on both ends:
with pp=2 and ``loop=True`` prev and next are the same rank, and the forward message is still
the first sent and the first received. The tests check both exhaustively with a simulator of
both modes (every combination of active links, 2-5 stages, with and without loop).
"""

from __future__ import annotations

from typing import cast

import torch

from ..errors import ShardkitError, ShardkitTypeError
from . import _wire
from ._negotiate import hello_msgs, read_header, settle
from ._packed import Recv, send_transfer
from ._transfer import ShapeCache, Transfer, header_msg, payload_msg, post, posting_order, sorted_post

__all__ = ["P2PWork", "exchange"]


def _ordered(transfers: list[Transfer], api: str, checked: bool, cache: ShapeCache | None = None) -> list:
    """Transfer by transfer in slot order, each complete (header or hellos, payload) before the
    next: the sends and receives of :mod:`._packed` (a receiver waits for its header before
    posting the payload receive, unless ``cache`` holds the channel's shape: then both are posted
    at once). ``checked``: the check mode's hellos instead.

    On gloo, a packed cached receive that is its group's only receive in the call is posted in
    its slot and read after the call's later messages are posted: an odd stage's
    ``send_backward_recv_forward`` then sends its gradient without first waiting for the
    activation (the peer's send was posted already), one latency fewer on the 1F1B critical path.
    Gloo matches each pair's messages per direction in posting order and never blocks on a post,
    so a changed shape (dummy, then the payload received after the later posts) still pairs up.
    NCCL runs a peer's P2P in order on one stream, where that late payload receive would sit
    behind this end's later send while the peer's send of the payload blocks: not done there."""
    works: list = []
    late: list[Recv] = []
    order = posting_order([(t.gi, t.g.rank, t.send, t.towards) for t in transfers])
    receives = [t.gi for t in transfers if not t.send]
    for i in order:
        t = transfers[i]
        if checked:
            for w in sorted_post(hello_msgs(t, api), api, batched=False):
                w.wait()
            settle(t, api)
            works += post([m for m in [payload_msg(t)] if m is not None], False, api)
            continue
        channel = cache if t.header else None  # a static transfer has no negotiated shape
        if t.send:
            works += send_transfer(t, channel, api)
            continue
        r = Recv(t, channel, api)
        if r.packed and receives.count(t.gi) == 1 and t.g.pg.name().lower() == "gloo":
            late.append(r)
        else:
            works += r.finish()
    for r in late:
        works += r.finish()
    return works


def _phased(transfers: list[Transfer], api: str, checked: bool) -> list:
    """One ``batch_isend_irecv`` per group and phase: all headers or hellos (waited), then all
    payloads; slot order within each batch (it fixes the FIFO pairing)."""
    works = []
    if checked:
        for w in sorted_post([m for t in transfers for m in hello_msgs(t, api)], api):
            w.wait()
        for t in transfers:
            settle(t, api)
        return sorted_post([m for m in map(payload_msg, transfers) if m is not None], api)
    with_header = [t for t in transfers if t.header]
    if with_header:
        for w in sorted_post([header_msg(t) for t in with_header], api):
            w.wait()  # the receivers need the shapes now
        for t in with_header:
            if not t.send:
                read_header(t, api)
    works += sorted_post([m for m in map(payload_msg, transfers) if m is not None], api)
    return works


def exchange(
    transfers: list[Transfer], api: str, batched: bool, checked: bool, reduce: str, cache: ShapeCache | None = None
) -> P2PWork:
    """Post every message of one call (see the module docstring) and return its handle.

    Errors found on this rank are raised only after every message of the exchange was posted
    and completed, so the channels stay in step and the groups stay usable; a sender error with
    no header to carry it (static shapes, checks off) is raised before anything is posted.
    """
    for t in transfers:
        if t.send and t.error is not None and not t.header:
            raise t.error
    pending = _phased(transfers, api, checked) if batched else _ordered(transfers, api, checked, cache)
    work = P2PWork(api, transfers, pending, reduce)
    errors = [t.error for t in transfers if t.error is not None]
    if errors:
        work.complete()
        raise errors[0]
    return work


class P2PWork:
    """Handle of an asynchronous pipeline transfer (the ``async_op=True`` result).

    ``wait()`` blocks until every message of the call completed and returns the received tensor
    (None for a send-only call); call it before reading that tensor or modifying the tensor that
    was sent. Waiting again returns the same result (or raises the same error).
    """

    def __init__(self, api: str, transfers: list[Transfer], works: list, reduce: str) -> None:
        self._api, self._transfers, self._works, self._reduce = api, transfers, works, reduce
        self._done = False
        self._result: torch.Tensor | None = None
        self._error: ShardkitError | None = None

    def is_completed(self) -> bool:
        """Whether every message has completed (``wait()`` would not block)."""
        return self._done or all(w.is_completed() for w in self._works)

    def complete(self) -> None:
        works, self._works = self._works, []  # a gloo work must not be waited twice
        for w in works:
            w.wait()

    def wait(self) -> torch.Tensor | None:
        """Complete the transfer; return the received tensor (None when this call only sends).

        Raises:
            ShardkitError: tensors received from several groups differ in shape or dtype, or
                ``reduce="mean"`` over an integer dtype.
        """
        if not self._done:
            self.complete()
            self._done = True
            try:
                # every receive holds its tensor once complete (an error status raised in exchange)
                received = cast("list[torch.Tensor]", [t.payload for t in self._transfers if not t.send])
                self._result = _reduce(received, self._reduce, self._api) if received else None
            except ShardkitError as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._result


def _reduce(tensors: list[torch.Tensor], how: str, api: str) -> torch.Tensor:
    """One received tensor as is; several (one per group) averaged or summed."""
    if len(tensors) == 1:
        return tensors[0]
    first = tensors[0]
    bad = [i for i, t in enumerate(tensors) if t.shape != first.shape or t.dtype != first.dtype]
    if bad:
        got = "; ".join(f"group {i}: {_wire.describe(t.shape, t.dtype)}" for i, t in enumerate(tensors))
        raise ShardkitError(f"{api}: tensors received from {len(tensors)} groups must match to be reduced, got {got}")
    if how == "mean" and not (first.is_floating_point() or first.is_complex()):
        raise ShardkitTypeError(
            f"{api}: reduce='mean' over {len(tensors)} groups needs a floating dtype, got {first.dtype}"
        )
    # Accumulate low-precision floats in float32, as the MindSpeed-MM multi-group receive does.
    acc = first.dtype
    if first.is_floating_point() and first.dtype.itemsize < 4:
        acc = torch.float32
    elif first.dtype == torch.bool:
        acc = torch.int64  # a sum of flags; .to(bool) below makes it a logical or
    stacked = torch.stack(tensors)
    out = stacked.mean(0, dtype=acc) if how == "mean" else stacked.sum(0, dtype=acc)
    return out.to(first.dtype)
