"""The messages of the P2P engine (:mod:`._exchange`): the slot order they are posted in, a
transfer as one rank sees it, the negotiated shapes per channel, and posting itself.

A transfer is a header (dynamic shapes; see :mod:`._wire`) and the payload. Matching never
relies on tags: messages are posted in the fixed even/odd slot order of :func:`order_key`, so
NCCL's FIFO pairing between two ranks matches them (why it is safe: :mod:`._exchange`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from ..comm import ledger
from ..comm._compat import irecv, isend, p2p_op
from ..comm._group import GroupInfo
from ..errors import ShardkitError
from . import _wire
from ._wire import HEADER_LEN, OK

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["Channel", "ShapeCache", "ShapeTrust", "Transfer", "order_key", "posting_order", "message_order"]

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


def message_order(items) -> list[int]:
    """Indices of ``items`` = ``[(group_index, group_rank, is_send, towards, phase), ...]`` in
    posting order: :func:`posting_order`, then forward before backward. The tie-break matters
    only for hellos, where one link carries one message per transfer in each direction."""
    return sorted(range(len(items)), key=lambda i: (items[i][0], order_key(*items[i][1:4]), items[i][4] != "forward"))


class ShapeTrust:
    """Whether a stage's negotiated shapes are trusted, and the device flag of what broke the trust.

    Trusted (``on``, set by the runner for a call whose caller promised the same shapes as its
    previous completed call, :func:`~.runner.run_schedule`'s ``shape_key``): a receive of a
    negotiated channel takes the cached shape without reading the header on the host (the read
    would stall the host until the message arrived). It still compares the header with the stored
    one, on the device, into :attr:`mismatch`; a sender whose tensor does not have the agreed
    shape sends a message of the agreed shape with its own header (so the receiver's comparison
    fails too), nothing after it, and sets its own flag. The caller reads the flag with its own
    next read (the trainer: with the loss and the gradient norm) and raises on every rank.
    """

    def __init__(self) -> None:
        self.on = False
        self.key: object = None  # the shape key of the last completed call (None: none)
        self.mismatch: torch.Tensor | None = None  # 0-d bool on the device, or None

    def begin(self, key: object, kept: bool) -> None:
        """A call starts: trusted when it runs on the kept caches of a completed call whose
        ``key`` (not None) it repeats; a call on new caches forgets the key."""
        self.on = kept and key is not None and key == self.key
        if not kept:
            self.key = None

    def end(self, key: object) -> None:
        """The call completed on this rank: its key is the one the next call may repeat."""
        self.on, self.key = False, key

    def note(self, bad: torch.Tensor) -> None:
        """OR the 0-d bool ``bad`` (on the device) into :attr:`mismatch`; no host sync."""
        self.mismatch = bad if self.mismatch is None else self.mismatch | bad  # one device per stage

    def fit(self, grad: torch.Tensor | None, output: torch.Tensor) -> torch.Tensor | None:
        """``grad`` for ``output``; under trust, a gradient of the agreed shape that is not the
        output's (a broken promise: flagged already) becomes zeros, so that the call runs to its
        end on every rank and the caller raises everywhere from the flag instead of here alone."""
        if self.on and grad is not None and grad.shape != output.shape:
            return torch.zeros_like(output)
        return grad

    def take(self) -> torch.Tensor | None:
        """The flag of the calls since the last take (None: nothing trusted was received)."""
        flag, self.mismatch = self.mismatch, None
        return flag


class Channel(NamedTuple):
    """A channel's negotiated payload: its shape and dtype, its size, and the header an ``OK``
    transfer of it carries (uint8, ``HEADER_LEN * 8`` bytes, on ``device``, where this end's
    transfers were): derived from (shape, dtype), so equal on both ends whenever those are."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    header: torch.Tensor
    device: torch.device
    trust: ShapeTrust | None = None  # the cache's (shared by its channels)


class ShapeCache:
    """Negotiated payload shapes per P2P channel, for one run of transfers (e.g. one
    ``run_schedule`` call): create one on every rank at the same point of the program and pass it
    to every transfer of that run. See the module docstring for why the copies cannot diverge."""

    def __init__(self, trust: ShapeTrust | None = None) -> None:
        self.trust = ShapeTrust() if trust is None else trust
        self._last: dict[tuple, Channel] = {}  # (id of the process group, is_send, peer) -> Channel
        # (id of the process group, peer) -> (packed send buffer, the work of its last send, the
        # view of its payload bytes when its header bytes hold that payload's OK header, else None)
        self._packed: dict[tuple, tuple[torch.Tensor, Any, torch.Tensor | None]] = {}

    def packed_buffer(self, pg: dist.ProcessGroup, peer: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """A ``nbytes`` uint8 send buffer for a packed (header + payload) message to group rank
        ``peer`` of ``pg``: the one the last packed send to that peer used when that send has
        completed (c10d no longer reads it), else a new one. Why: a fresh CPU buffer of a few
        hundred KiB comes from ``mmap`` and pays a page fault per 4 KiB it touches, measured as
        more than the copy itself; CUDA's caching allocator recycles blocks, so other devices get
        fresh buffers."""
        held = self._packed.get((id(pg), peer))
        if held is not None:
            buf, work, _ = held
            if buf.numel() == nbytes and buf.device == device and work.is_completed():
                return buf
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def packed_body(
        self, pg: dist.ProcessGroup, peer: int, ch: Channel, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(buffer, payload view)`` for a packed send of ``ch``'s cached shape (status OK) to
        ``peer``: the buffer of :meth:`packed_buffer` with ``ch.header`` in its first bytes and
        the rest viewed as ``ch.shape`` / ``ch.dtype``. A repeat after a completed send of the
        same shape finds both already made: the send is then one copy of the payload (no header
        write, no ``cat`` of flat views: each tensor op costs microseconds of host time)."""
        held = self._packed.get((id(pg), peer))
        if held is not None:
            buf, work, body = held
            if (
                body is not None
                and body.dtype == ch.dtype
                and body.shape == ch.shape
                and buf.device == device
                and work.is_completed()
            ):
                return buf, body
        hb = ch.header.numel()
        buf = self.packed_buffer(pg, peer, hb + ch.nbytes, device)
        buf[:hb].copy_(ch.header)
        return buf, buf[hb:].view(ch.dtype).view(ch.shape)

    def hold_packed(
        self, pg: dist.ProcessGroup, peer: int, buf: torch.Tensor, work: object, body: torch.Tensor | None = None
    ) -> None:
        """Remember a CPU packed send's buffer and work (and ``body``, the payload view of
        :meth:`packed_body` when the buffer holds an OK header of its shape), for the next send."""
        if buf.is_cpu:
            self._packed[(id(pg), peer)] = (buf, work, body)

    def lookup(self, pg: dist.ProcessGroup, send: bool, peer: int) -> Channel | None:
        """The channel towards (``send``) or from group rank ``peer`` of ``pg``, if negotiated."""
        return self._last.get((id(pg), send, peer))

    def get(self, t: Transfer) -> Channel | None:
        return self.lookup(t.g.pg, t.send, t.peer)

    def put(self, t: Transfer, shape: Sequence[int], dtype: torch.dtype) -> None:
        key = (id(t.g.pg), t.send, t.peer)
        old = self._last.get(key)
        if old is not None and old.dtype == dtype and old.shape == shape and old.device == t.device:
            return  # a repeat: the entry (and its encoded header) stays
        if old is not None and self.trust.on:
            return  # trusted: the agreed shape stays on both ends (a change was flagged, ShapeTrust)
        n = dtype.itemsize
        for d in shape:
            n *= d
        header = _wire.encode(OK, dtype, shape, t.device).view(torch.uint8)
        self._last[key] = Channel(tuple(shape), dtype, n, header, t.device, self.trust)


@dataclass(eq=False, slots=True)
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


def post(msgs, batched: bool, api: str) -> list:
    """Post ``(transfer, is_send, tensor, ledger_phase)`` messages, already in posting order."""
    if not batched:
        return [post_one(t.g, t.peer, s, tensor, label, api) for t, s, tensor, label in msgs]
    for t, is_send, tensor, label in msgs:
        _record(t.g, t.peer, is_send, tensor, label, api)
    per_group: dict[int, list] = {}  # batch_isend_irecv takes one group per call
    for t, s, tensor, _ in msgs:
        per_group.setdefault(t.gi, []).append(p2p_op(s, tensor, t.g.pg, t.peer))
    return [w for ops in per_group.values() for w in dist.batch_isend_irecv(ops)]


def post_one(g: GroupInfo, peer: int, is_send: bool, tensor: torch.Tensor, label: str, api: str):
    """Record and post one message (``isend`` or ``irecv`` with group rank ``peer``); its work."""
    _record(g, peer, is_send, tensor, label, api)
    return (isend if is_send else irecv)(tensor, g.pg, peer)


def _record(g: GroupInfo, peer: int, is_send: bool, tensor: torch.Tensor, label: str, api: str) -> None:
    """The ledger entry of one message, made just before it is posted (:func:`.ledger.record`)."""
    n = tensor.nbytes
    ledger.record(
        "send" if is_send else "recv",
        api,
        label,
        g.size,
        n if is_send else 0,
        0 if is_send else n,
        pg=g.pg,
        shape=tensor.shape,
        peer=peer,
        dtype=tensor.dtype,
    )


Message = tuple["Transfer", bool, torch.Tensor, str]  # (transfer, is_send, tensor, ledger phase)


def header_msg(t: Transfer) -> Message:
    if t.send:
        assert t.payload is not None  # a sender's header describes its tensor
        hdr = _wire.encode(t.status, t.payload.dtype, t.payload.shape, t.device)
    else:
        hdr = torch.empty(HEADER_LEN, dtype=torch.int64, device=t.device)
    t.hdr = hdr
    # A header on a static transfer exists only for the checks: count it as "check" traffic.
    return (t, t.send, hdr, "check" if t.shape is not None else t.phase)


def payload_msg(t: Transfer) -> Message | None:
    """The payload message, or None (zero elements, or an error status: nothing follows)."""
    if not t.send and not t.header:
        assert t.shape is not None  # a receive without header has a declared static shape
        t.payload = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if t.status != OK or t.payload is None or t.payload.numel() == 0:
        return None
    return (t, t.send, t.payload, t.phase)


def sorted_post(msgs, api: str, batched: bool = True) -> list:
    """:func:`post` in :func:`message_order`."""
    order = message_order([(t.gi, t.g.rank, s, t.towards, t.phase) for t, s, _, _ in msgs])
    return post([msgs[i] for i in order], batched, api)
