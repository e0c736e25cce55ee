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
the caller). Each end keeps, per channel (group, direction, peer), the shape and dtype of the
last negotiated payload; both ends update it from the same header (the sender from the header it
sends, the receiver from the header it receives), only when the header's status is ``OK``, so
the two copies are equal after every transfer whatever the shapes do. With a cached shape the
receiver posts the header receive and a payload receive of the cached shape together (no round
trip: the header is no longer waited for before the payload is posted); up to ``PACK_MAX_BYTES``
the two are one message, the header in front of the payload. The sender always sends a message
of the cached shape with the header: the payload when its tensor has that shape and dtype, else
a dummy of the cached shape followed by the real payload (or nothing after an error status).
The header still travels every time, so a shape change or an error is always seen.
Each channel also stores the header of its cached shape, so a repeat is packed by one ``cat``
and accepted by one comparison. On gloo, a combined call's packed cached receive is read only
after the call's later messages are posted (see :func:`_ordered`).

Why it is safe. (a) Each even/odd pair of neighbours has one side sending first and the other
receiving first, so with blocking (rendezvous) semantics, the worst case of NCCL, every exchange
completes. (b) Towards one peer, "next" traffic is posted before "prev" traffic on both ends:
with pp=2 and ``loop=True`` prev and next are the same rank, and the forward message is still
the first sent and the first received. The tests check both exhaustively with a simulator of
both modes (every combination of active links, 2-5 stages, with and without loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from ..comm import ledger
from ..comm._compat import irecv, isend, p2p_op
from ..comm._group import GroupInfo
from ..errors import RankMismatchError, ShardkitError, ShardkitTypeError
from . import _wire
from ._wire import HEADER_LEN, HELLO_LEN, OK

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "Transfer",
    "P2PWork",
    "ShapeCache",
    "Channel",
    "cached_recv",
    "cached_send",
    "exchange",
    "order_key",
    "posting_order",
    "message_order",
]

_SLOTS = (
    {(True, "next"): 0, (False, "prev"): 1, (True, "prev"): 2, (False, "next"): 3},  # even stages
    {(False, "prev"): 0, (True, "next"): 1, (False, "next"): 2, (True, "prev"): 3},  # odd stages
)


def order_key(group_rank: int, is_send: bool, towards: str) -> int:
    """Position of a message in its phase: the slot order of the module docstring."""
    return _SLOTS[group_rank % 2][(is_send, towards)]


def posting_order(items) -> list[int]:
    """Indices of ``items`` = ``[(group_index, group_rank, is_send, towards), ...]`` in posting
    order: groups in the order the caller listed them, slots by :func:`order_key` within each."""
    return sorted(range(len(items)), key=lambda i: (items[i][0], order_key(*items[i][1:])))


class Channel(NamedTuple):
    """A channel's negotiated payload: its shape and dtype, its size, and the header an ``OK``
    transfer of it carries (uint8, ``HEADER_LEN * 8`` bytes, on ``device``, where this end's
    transfers were): derived from (shape, dtype), so equal on both ends whenever those are."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    header: torch.Tensor
    device: torch.device


class ShapeCache:
    """Negotiated payload shapes per P2P channel, for one run of transfers (e.g. one
    ``run_schedule`` call): create one on every rank at the same point of the program and pass it
    to every transfer of that run. See the module docstring for why the copies cannot diverge."""

    def __init__(self) -> None:
        self._last: dict[tuple, Channel] = {}  # (id of the process group, is_send, peer) -> Channel

    def get(self, t: Transfer) -> Channel | None:
        return self._last.get((id(t.g.pg), t.send, t.peer))

    def put(self, t: Transfer, shape: Sequence[int], dtype: torch.dtype) -> None:
        key = (id(t.g.pg), t.send, t.peer)
        old = self._last.get(key)
        if old is not None and old.dtype == dtype and old.shape == shape and old.device == t.device:
            return  # a repeat: the entry (and its encoded header) stays
        n = dtype.itemsize
        for d in shape:
            n *= d
        header = _wire.encode(OK, dtype, shape, t.device).view(torch.uint8)
        self._last[key] = Channel(tuple(shape), dtype, n, header, t.device)


@dataclass(eq=False)
class Transfer:
    """One message stream of an exchange, as seen from this rank."""

    send: bool
    towards: str  # "next" or "prev"
    gi: int  # index of the group in the caller's list (posting order)
    g: GroupInfo
    peer: int  # group rank of the other end
    phase: str  # "forward" or "backward", for the ledger
    device: torch.device
    shape: tuple[int, ...] | None  # declared static shape
    dtype: torch.dtype | None  # declared dtype
    header: bool  # a header precedes the payload
    payload: torch.Tensor | None = None  # send: the contiguous tensor; recv: the buffer
    status: int = OK  # the header status sent or received
    error: ShardkitError | None = None  # raised on this rank once the exchange is complete
    hdr: torch.Tensor | None = None
    hello_out: torch.Tensor | None = None  # checks on: this end's hello
    hello_in: torch.Tensor | None = None  # checks on: the other end's hello

    def where(self) -> str:
        return f"stage {self.g.rank} of {self.g.size}"


def _post(msgs, batched: bool, api: str) -> list:
    """Post ``(transfer, is_send, tensor, ledger_phase)`` messages, already in posting order."""
    for t, is_send, tensor, label in msgs:
        n = tensor.nbytes
        ledger.record(
            "send" if is_send else "recv",
            api,
            label,
            t.g.size,
            n if is_send else 0,
            0 if is_send else n,
            pg=t.g.pg,
            shape=tensor.shape,
            peer=t.peer,
        )
    if not batched:
        return [(isend if s else irecv)(tensor, t.g.pg, t.peer) for t, s, tensor, _ in msgs]
    per_group: dict[int, list] = {}  # batch_isend_irecv takes one group per call
    for t, s, tensor, _ in msgs:
        per_group.setdefault(t.gi, []).append(p2p_op(s, tensor, t.g.pg, t.peer))
    return [w for ops in per_group.values() for w in dist.batch_isend_irecv(ops)]


def _header_msg(t: Transfer):
    if t.send:
        t.hdr = _wire.encode(t.status, t.payload.dtype, t.payload.shape, t.device)
    else:
        t.hdr = torch.empty(HEADER_LEN, dtype=torch.int64, device=t.device)
    # A header on a static transfer exists only for the checks: count it as "check" traffic.
    return (t, t.send, t.hdr, "check" if t.shape is not None else t.phase)


def _payload_msg(t: Transfer):
    """The payload message, or None (zero elements, or an error status: nothing follows)."""
    if not t.send and not t.header:
        t.payload = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if t.status != OK or t.payload is None or t.payload.numel() == 0:
        return None
    return (t, t.send, t.payload, t.phase)


def _hello_msgs(t: Transfer, api: str) -> list:
    """Checks on: this end's hello out and the other end's hello in (see :mod:`._wire`)."""
    if t.send and t.payload is not None:
        mine = _wire.encode_hello(True, t.phase, t.g.rank, api, t.status, t.payload.dtype, t.payload.shape, t.device)
    else:  # a receiver's declaration, or a sender whose arguments were refused (no tensor to describe)
        mine = _wire.encode_hello(t.send, t.phase, t.g.rank, api, t.status, t.dtype, t.shape, t.device)
    t.hello_out, t.hello_in = mine, torch.empty(HELLO_LEN, dtype=torch.int64, device=t.device)
    return [(t, True, mine, "check"), (t, False, t.hello_in, "check")]


def _misuse(t: Transfer, peer: _wire.Hello, api: str) -> ShardkitError | None:
    """Two senders, two receivers, or a forward message meeting a backward receive. The message
    is built from both hellos in stage order, so both ends raise the same text."""
    ends = sorted([(t.g.rank, t.send, t.phase, api), (peer.rank, peer.send, peer.phase, peer.api)])
    who = " and ".join(f"stage {r} ({a}: {'sends' if s else 'receives'} {p})" for r, s, p, a in ends)
    if t.send == peer.send:
        what = "both send to each other" if t.send else "both wait to receive from each other"
    elif t.phase != peer.phase:
        what = "disagree on the direction: a forward message (activations) meets a backward one (gradients)"
    else:
        return None
    return RankMismatchError(f"P2P misuse in a pipeline group of {t.g.size}: {who} {what}; nothing was transferred")


def _past_end(t: Transfer, mine: _wire.Hello, peer: _wire.Hello) -> ShardkitError | None:
    """A call addressed past the pipeline's end (status ``PAST_END``: said to the stage on its
    other side). The message is built from both hellos in stage order: the same text on both ends."""
    ends = sorted([mine, peer], key=lambda e: e.rank)
    past = [e for e in ends if e.meta.status == _wire.PAST_END]
    if not past:
        return None
    who = " and ".join(f"stage {e.rank} ({e.api}: {'sends' if e.send else 'receives'} {e.phase})" for e in ends)
    why = []
    for e in past:
        nxt = e.send == (e.phase == "forward")  # sends forward or receives backward: towards the next stage
        why.append(
            f"stage {e.rank} is the {'last' if nxt else 'first'} of {t.g.size} pipeline stages and has no "
            f"{'next' if nxt else 'previous'} stage"
        )
    return ShardkitError(
        f"P2P in a pipeline group of {t.g.size}: {who}: {'; '.join(why)} (pass loop=True to connect "
        "the last stage to the first); nothing was transferred"
    )


def _declarations(t: Transfer, mine: _wire.Hello, peer: _wire.Hello) -> ShardkitError | None:
    """The sender's tensor against the receiver's declaration, judged from the two hellos in
    (sender, receiver) order, so both ends raise the same text and no payload moves."""
    s, r = (mine, peer) if mine.send else (peer, mine)
    where = (
        f"the {s.phase} message of stage {s.rank} ({s.api}) to stage {r.rank} ({r.api}) in a pipeline group "
        f"of {t.g.size}"
    )
    sent = _wire.describe(s.meta.shape, s.meta.dtype)
    refused = [e for e in (s, r) if e.meta.status == _wire.BAD_ARGUMENTS]
    if refused:
        who = " and ".join(f"stage {e.rank} ({e.api})" for e in refused)
        return ShardkitError(
            f"P2P: {where}: {who} raised an argument error (its own message is the cause on that "
            "rank); nothing was transferred"
        )
    if s.meta.status == _wire.BAD_DECLARATION:
        return ShardkitError(
            f"P2P: {where}: the sender's tensor ({sent}) does not match its own declared static "
            "shape/dtype; nothing was transferred"
        )
    if s.meta.status != OK:
        return ShardkitError(
            f"P2P: {where}: the sender's tensor cannot be described by a header (ndim > 16 or a "
            "dtype without a wire code); nothing was transferred"
        )
    if (r.meta.dtype is not None and r.meta.dtype != s.meta.dtype) or (
        r.meta.shape is not None and r.meta.shape != s.meta.shape
    ):
        return RankMismatchError(
            f"P2P: {where}: the receiver declared {_wire.describe(r.meta.shape, r.meta.dtype)} "
            f"but the sender sent {sent}; nothing was transferred"
        )
    return None


def _settle(t: Transfer, api: str) -> None:
    """Checks on, both hellos exchanged: a call past the pipeline's end, a misuse or a declaration
    error (the same on both ends, no payload follows), else the receiver reads the sender's header."""
    source = f"stage {t.peer} of {t.g.size}"
    peer = _wire.decode_hello(t.hello_in, api, source)
    mine = _wire.decode_hello(t.hello_out, api, t.where())
    error = _past_end(t, mine, peer) or _misuse(t, peer, api) or _declarations(t, mine, peer)
    if error is not None:
        t.error, t.status = error, _wire.MISUSE
        return
    if not t.send:
        t.hdr = t.hello_in[:HEADER_LEN]
        _read_header(t, api)


def _read_header(t: Transfer, api: str) -> None:
    """Decode a received header; set the payload buffer, or the error to raise later."""
    source = f"stage {t.peer} of {t.g.size}"
    meta = _wire.decode(t.hdr, api, source)
    t.status = meta.status
    if meta.status != OK:
        why = (
            "its tensor does not match its own declared static shape/dtype"
            if meta.status == _wire.BAD_DECLARATION
            else "its tensor cannot be described by a header (ndim > 16 or a dtype without a wire code)"
        )
        t.error = ShardkitError(f"{api}: {source} (the sender) reported that {why}; no payload was sent to {t.where()}")
        return
    if (t.dtype is not None and meta.dtype != t.dtype) or (t.shape is not None and meta.shape != t.shape):
        # The payload still follows (the sender cannot know yet): receive it, then raise.
        t.error = RankMismatchError(
            f"{api}: {t.where()} declared {_wire.describe(t.shape, t.dtype)} but {source} sent "
            f"{_wire.describe(meta.shape, meta.dtype)}"
        )
    t.payload = torch.empty(meta.shape, dtype=meta.dtype, device=t.device)


# Cached shapes up to this many payload bytes travel in one message, the header in front of the
# payload (a copy on each side, cheap below gloo's ~256 KiB latency/bandwidth crossover, where the
# second message's latency costs more); larger ones as two messages posted together.
PACK_MAX_BYTES = 256 * 1024
_HB = HEADER_LEN * 8  # header bytes; a multiple of 16, so the payload view after it is aligned


def cached_send(t: Transfer, ch: Channel, api: str) -> list:
    """Header, then a message of the cached shape (the payload, or a dummy plus the payload);
    packed into one message when the cached payload is small. A repeated shape is one ``cat``
    of the channel's stored header and the payload (no header encoding, one copy)."""
    x = t.payload
    same = t.status == OK and x.dtype == ch.dtype and x.shape == ch.shape
    if ch.nbytes <= PACK_MAX_BYTES:
        if same:
            header = ch.header if ch.device == t.device else ch.header.to(t.device)
            buf = torch.cat([header, x.reshape(-1).view(torch.uint8)])
        else:
            buf = torch.empty(_HB + ch.nbytes, dtype=torch.uint8, device=t.device)
            buf[:_HB].view(torch.int64).copy_(_wire.encode(t.status, x.dtype, x.shape, t.device))
        msgs = [(t, True, buf, t.phase)]
    else:
        msgs = [
            _header_msg(t),
            (t, True, x if same else torch.empty(ch.shape, dtype=ch.dtype, device=t.device), t.phase),
        ]
    if not same and (pay := _payload_msg(t)) is not None:
        msgs.append(pay)
    return _post(msgs, False, api)


def _post_packed(t: Transfer, ch: Channel, api: str):
    """Post the one receive of a packed transfer (header + payload of the cached shape)."""
    buf = torch.empty(_HB + ch.nbytes, dtype=torch.uint8, device=t.device)
    return buf, _post([(t, False, buf, t.phase)], False, api)[0]


def _read_packed(t: Transfer, ch: Channel, buf: torch.Tensor, work, api: str) -> list:
    """Complete a packed receive: a header equal to the channel's stored one (the cached shape,
    status OK) is accepted by one comparison, without decoding; else :func:`_after_header`."""
    work.wait()
    hdr, body = buf.split_with_sizes((_HB, ch.nbytes))
    if (t.dtype is None or t.dtype == ch.dtype) and ch.device == t.device and torch.equal(hdr, ch.header):
        t.payload = body.view(ch.dtype).view(ch.shape)
        return []
    t.hdr = hdr.view(torch.int64)
    return _after_header(t, ch, body.view(ch.dtype).view(ch.shape), [], api)


def cached_recv(t: Transfer, ch: Channel, api: str) -> list:
    """The mirror of :func:`cached_send`: header and a receive of the cached shape posted
    together (or one packed receive); the real payload after them only when the header
    announces another shape."""
    if ch.nbytes <= PACK_MAX_BYTES:
        return _read_packed(t, ch, *_post_packed(t, ch, api), api)
    pre = torch.empty(ch.shape, dtype=ch.dtype, device=t.device)
    posted = _post([_header_msg(t), (t, False, pre, t.phase)], False, api)
    posted[0].wait()
    return _after_header(t, ch, pre, posted[1:], api)


def _after_header(t: Transfer, ch: Channel, pre: torch.Tensor, rest: list, api: str) -> list:
    """The header was read into ``t.hdr``: keep ``pre`` (the cached shape arrived), or wait for
    the dummy and receive the real payload (if any) after it."""
    _read_header(t, api)
    if t.status == OK and t.payload.dtype == ch.dtype and t.payload.shape == ch.shape:
        t.payload = pre
        return rest
    for w in rest:
        w.wait()  # a dummy: the real payload (if any) follows
    pay = _payload_msg(t)
    return _post([pay], False, api) if pay is not None else []


def _ordered(transfers: list[Transfer], api: str, checked: bool, cache: ShapeCache | None = None) -> list:
    """Transfer by transfer in slot order, each complete (header or hellos, payload) before the
    next; a receiver waits for its header before posting the payload receive, unless ``cache``
    holds the channel's shape (then both are posted at once). ``checked``: the check mode's hellos.

    On gloo, a packed cached receive that is its group's only receive in the call is posted in
    its slot and read after the call's later messages are posted: an odd stage's
    ``send_backward_recv_forward`` then sends its gradient without first waiting for the
    activation (the peer's send was posted already), one latency fewer on the 1F1B critical path.
    Gloo matches each pair's messages per direction in posting order and never blocks on a post,
    so a changed shape (dummy, then the payload received after the later posts) still pairs up.
    NCCL runs a peer's P2P in order on one stream, where that late payload receive would sit
    behind this end's later send while the peer's send of the payload blocks: not done there."""
    works, late = [], []
    order = posting_order([(t.gi, t.g.rank, t.send, t.towards) for t in transfers])
    receives = [t.gi for t in transfers if not t.send]
    for i in order:
        t = transfers[i]
        use_cache = cache is not None and t.header and not checked
        cached = cache.get(t) if use_cache else None
        if cached is not None:
            if (
                not t.send
                and cached.nbytes <= PACK_MAX_BYTES
                and receives.count(t.gi) == 1
                and t.g.pg.name().lower() == "gloo"
            ):
                late.append((t, cached, *_post_packed(t, cached, api)))
                continue
            works += (cached_send if t.send else cached_recv)(t, cached, api)
        elif checked:
            for w in _sorted_post(_hello_msgs(t, api), api, batched=False):
                w.wait()
            _settle(t, api)
            works += _post([m for m in [_payload_msg(t)] if m is not None], False, api)
        else:
            if t.header:
                posted = _post([_header_msg(t)], False, api)
                if t.send:
                    works += posted
                else:
                    posted[0].wait()
                    _read_header(t, api)
            works += _post([m for m in [_payload_msg(t)] if m is not None], False, api)
        if use_cache and t.status == OK:
            # Both ends record the header's shape: the sender its own, the receiver the one read.
            cache.put(t, t.payload.shape, t.payload.dtype)
    for t, cached, buf, work in late:
        works += _read_packed(t, cached, buf, work, api)
        if t.status == OK:
            cache.put(t, t.payload.shape, t.payload.dtype)
    return works


def _phased(transfers: list[Transfer], api: str, checked: bool) -> list:
    """One ``batch_isend_irecv`` per group and phase: all headers or hellos (waited), then all
    payloads; slot order within each batch (it fixes the FIFO pairing)."""
    works = []
    if checked:
        for w in _sorted_post([m for t in transfers for m in _hello_msgs(t, api)], api):
            w.wait()
        for t in transfers:
            _settle(t, api)
        return _sorted_post([m for m in map(_payload_msg, transfers) if m is not None], api)
    with_header = [t for t in transfers if t.header]
    if with_header:
        for w in _sorted_post([_header_msg(t) for t in with_header], api):
            w.wait()  # the receivers need the shapes now
        for t in with_header:
            if not t.send:
                _read_header(t, api)
    works += _sorted_post([m for m in map(_payload_msg, transfers) if m is not None], api)
    return works


def message_order(items) -> list[int]:
    """Indices of ``items`` = ``[(group_index, group_rank, is_send, towards, phase), ...]`` in
    posting order: :func:`posting_order`, then forward before backward. The tie-break matters
    only for hellos, where one link carries one message per transfer in each direction."""
    return sorted(range(len(items)), key=lambda i: (items[i][0], order_key(*items[i][1:4]), items[i][4] != "forward"))


def _sorted_post(msgs, api: str, batched: bool = True) -> list:
    order = message_order([(t.gi, t.g.rank, s, t.towards, t.phase) for t, s, _, _ in msgs])
    return _post([msgs[i] for i in order], batched, api)


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
        self._done, self._result, self._error = False, None, None

    def is_completed(self) -> bool:
        """Whether every message has completed (``wait()`` would not block)."""
        return self._done or all(w.is_completed() for w in self._works)

    def complete(self) -> None:
        works, self._works = self._works, []
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
                received = [t.payload for t in self._transfers if not t.send]
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
