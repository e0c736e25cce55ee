"""One pipeline message on its channel, sent (:func:`send_transfer`) or received (:class:`Recv`):
static (the payload alone), negotiated (a header, then the payload) or cached (a channel whose
shape was negotiated sends the header with a message of that shape, packed into one message when
small). The one way of every sender and receiver: the public calls' exchange (:mod:`._exchange`),
their one-message path and the runner's links (:mod:`._links`).

Each end keeps, per channel (group, direction, peer), the shape and dtype of the last negotiated
payload (:class:`~._transfer.ShapeCache`); both ends update it from the same header (the sender
from the header it sends, the receiver from the one it receives), only when the header's status
is ``OK``, so the two copies are equal after every transfer whatever the shapes do. With a cached
shape the receiver posts the header receive and a payload receive of the cached shape together
(no round trip); up to ``PACK_MAX_BYTES`` the two are one message, the header in front of the
payload. The sender always sends a message of the cached shape with the header: the payload when
its tensor has that shape and dtype, else a dummy of the cached shape followed by the real
payload (or nothing after an error status), so a shape change or an error is always seen. A
repeat (every microbatch of a run) is one copy of the payload into the peer's reused send buffer,
whose header bytes stay in place (over the limit: the stored header bytes, then the payload), and
is accepted by one comparison with the receiver's stored header: no encoding, no decoding.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm._group import GroupInfo
from . import _wire
from ._negotiate import read_header
from ._transfer import Channel, Message, ShapeCache, Transfer, header_msg, payload_msg, post, post_one
from ._wire import HEADER_LEN, OK

__all__ = [
    "PACK_MAX_BYTES",
    "cached_send",
    "Recv",
    "send_transfer",
    "finish_cached_recv",
    "post_cached_recv",
    "post_packed",
    "read_packed",
    "send_repeat",
]

# Cached shapes up to this many payload bytes travel in one message, the header in front of the
# payload (one copy on the sending side, into a reused buffer; the receiver returns a view of what
# it received); larger ones as two messages posted together (the payload itself, no copy). On
# gloo a second message costs each end about as much host time as a whole single-message send
# (its record, post and wait), more than copying up to 2 MiB of a recently written payload:
# packed/two-message time 0.69-0.71 at 128-256 KiB, 0.77-0.89 at 1 MiB, 0.86-0.93 at 2 MiB, 1.08
# at 3 MiB, 1.10-1.15 at 4 MiB (benchmarks/RESULTS.md, session 21). The limit sits at half the
# crossover: a payload that is no longer in cache costs the copy more.
PACK_MAX_BYTES = 1024 * 1024
_HB = HEADER_LEN * 8  # header bytes; a multiple of 16, so the payload view after it is aligned


def cached_send(t: Transfer, ch: Channel, api: str, cache: ShapeCache) -> list:
    """Header, then a message of the cached shape (the payload, or a dummy plus the payload);
    packed into one message when the cached payload is small. A repeat of the cached shape is
    :func:`send_repeat`."""
    x = t.payload
    assert x is not None  # a sender's transfer holds its tensor
    if t.status == OK and x.dtype == ch.dtype and x.shape == ch.shape:
        return send_repeat(t.g, t.peer, t.phase, x, ch, cache, api)
    trust = ch.trust
    trusted = trust is not None and trust.on
    if trust is not None and trusted:
        # the receiver takes the agreed shape unread: flag the change, send nothing after it
        trust.note(ch.header.new_ones((), dtype=torch.bool))
    if ch.nbytes <= PACK_MAX_BYTES:
        buf = cache.packed_buffer(t.g.pg, t.peer, _HB + ch.nbytes, t.device)
        buf[:_HB].view(torch.int64).copy_(_wire.encode(t.status, x.dtype, x.shape, t.device))
        msgs: list[Message] = [(t, True, buf, t.phase)]
    else:
        msgs = [header_msg(t), (t, True, torch.empty(ch.shape, dtype=ch.dtype, device=t.device), t.phase)]
    if not trusted and (pay := payload_msg(t)) is not None:
        msgs.append(pay)
    works = post(msgs, False, api)
    if ch.nbytes <= PACK_MAX_BYTES:
        cache.hold_packed(t.g.pg, t.peer, msgs[0][2], works[0])
    return works


def send_repeat(g: GroupInfo, peer: int, phase: str, x: torch.Tensor, ch: Channel, cache: ShapeCache, api: str) -> list:
    """Send ``x`` (contiguous, status OK, the cached shape and dtype) to group rank ``peer``: one
    copy of the payload into the peer's reused send buffer, whose first bytes already hold the
    channel's stored header (:meth:`ShapeCache.packed_body`: no encoding, one copy, no
    allocation), or over the limit the stored header bytes and the payload as two messages. No
    :class:`Transfer`: a repeat changes nothing in the cache, and each step costs host time."""
    if ch.nbytes <= PACK_MAX_BYTES:
        buf, body = cache.packed_body(g.pg, peer, ch, x.device)
        body.copy_(x)
        work = post_one(g, peer, True, buf, phase, api)
        cache.hold_packed(g.pg, peer, buf, work, body)
        return [work]
    hdr = _header(ch, x.device).view(torch.int64)
    return [post_one(g, peer, True, hdr, phase, api), post_one(g, peer, True, x, phase, api)]


def _header(ch: Channel, device: torch.device) -> torch.Tensor:
    """The channel's stored header (uint8) on ``device``."""
    return ch.header if ch.device == device else ch.header.to(device)


def post_packed(t: Transfer, ch: Channel, api: str) -> tuple[torch.Tensor, Any]:
    """Post the one receive of a packed transfer (header + payload of the cached shape)."""
    buf = torch.empty(_HB + ch.nbytes, dtype=torch.uint8, device=t.device)
    return buf, post_one(t.g, t.peer, False, buf, t.phase, api)


def read_packed(t: Transfer, ch: Channel, buf: torch.Tensor, work, api: str) -> list:
    """Complete a packed receive: a header equal to the channel's stored one (the cached shape,
    status OK) on a receive that accepts the cached dtype on the channel's device is accepted by
    one comparison (:func:`_accepts`), its payload a view of the bytes after the header; any other
    is decoded and judged (:func:`_after_header`). The work is waited here, once (a gloo receive's
    work must not be waited twice: the second wait expects another message)."""
    work.wait()
    body = buf[_HB:].view(ch.dtype).view(ch.shape)
    if _accepts(t.dtype, t.device, ch, buf[:_HB]):
        t.payload = body
        return []
    t.hdr = buf[:_HB].view(torch.int64)
    return _after_header(t, ch, body, [], api)


def post_cached_recv(t: Transfer, ch: Channel, api: str) -> tuple[torch.Tensor, Any]:
    """:func:`cached_recv`'s posts: one packed receive, or the header and a receive of the
    cached shape (the chunked runner posts them early, :mod:`._mailbox`). Returns the buffer
    and the work (packed) or the works (header, cached shape) for :func:`finish_cached_recv`."""
    if ch.nbytes <= PACK_MAX_BYTES:
        return post_packed(t, ch, api)
    pre = torch.empty(ch.shape, dtype=ch.dtype, device=t.device)
    return pre, post([header_msg(t), (t, False, pre, t.phase)], False, api)


def finish_cached_recv(t: Transfer, ch: Channel, posted: tuple[torch.Tensor, Any], api: str) -> list:
    """Complete the receive :func:`post_cached_recv` posted; the works still to wait for."""
    if ch.nbytes <= PACK_MAX_BYTES:
        return read_packed(t, ch, *posted, api)
    pre, works = posted
    works[0].wait()
    assert t.hdr is not None  # header_msg gave the receive its buffer
    if _accepts(t.dtype, t.device, ch, t.hdr.view(torch.uint8)):
        t.payload = pre
        return works[1:]
    return _after_header(t, ch, pre, works[1:], api)


def _accepts(dtype: torch.dtype | None, device: torch.device, ch: Channel, hdr: torch.Tensor) -> bool:
    """Whether a received header (uint8) announces the cached shape with status OK, for a receive
    on ``device`` that accepts ``dtype`` (None: any): one comparison with the stored header, no
    decoding (a header that differs in any byte is decoded and judged by
    :func:`._negotiate.read_header`).

    Trusted shapes (:class:`._transfer.ShapeTrust`): the comparison runs on the device into the
    trust's flag and the cached shape is taken without a host read (``torch.equal`` would stall
    the host until the message arrived, once per message)."""
    if not ((dtype is None or dtype == ch.dtype) and ch.device == device):
        return False
    if ch.trust is not None and ch.trust.on:
        ch.trust.note((hdr != ch.header).any())
        return True
    return torch.equal(hdr, ch.header)


def _after_header(t: Transfer, ch: Channel, pre: torch.Tensor, rest: list, api: str) -> list:
    """The header was read into ``t.hdr``: keep ``pre`` (the cached shape arrived), or wait for
    the dummy and receive the real payload (if any) after it."""
    read_header(t, api)
    if t.status == OK and t.payload is not None and t.payload.dtype == ch.dtype and t.payload.shape == ch.shape:
        t.payload = pre
        return rest
    for w in rest:
        w.wait()  # a dummy: the real payload (if any) follows
    pay = payload_msg(t)
    return post([pay], False, api) if pay is not None else []


def send_transfer(t: Transfer, cache: ShapeCache | None, api: str) -> list:
    """Post the send of ``t`` (its tensor checked already, :func:`._links.check_own_tensor`): with
    ``cache`` holding the channel's shape :func:`cached_send`, else the header (negotiated) and
    the payload (none after an error status); the cache updated from an ``OK`` header. Its works."""
    ch = cache.get(t) if cache is not None else None
    if cache is not None and ch is not None:
        works = cached_send(t, ch, api, cache)
    else:
        works = post([m for m in (header_msg(t) if t.header else None, payload_msg(t)) if m is not None], False, api)
    if cache is not None and t.status == OK and t.payload is not None:  # both ends record an OK header's shape
        cache.put(t, t.payload.shape, t.payload.dtype)
    return works


class Recv:
    """The receive of ``t``, posted at construction: a static one's payload; with ``cache``
    holding the channel's shape the receive(s) of :func:`post_cached_recv`; else the header.
    :meth:`finish` runs the rest (the header compared or decoded, a changed shape receives the
    dummy and then the real payload, the cache updated only from an ``OK`` header)."""

    def __init__(self, t: Transfer, cache: ShapeCache | None, api: str) -> None:
        self.t, self.cache, self.api = t, cache, api
        self.ch = cache.get(t) if cache is not None else None
        if self.ch is not None:
            self.posted: Any = post_cached_recv(t, self.ch, api)
        else:
            first = header_msg(t) if t.header else payload_msg(t)
            self.posted = post([first] if first is not None else [], False, api)

    @property
    def packed(self) -> bool:
        """One packed message of the cached shape (complete once it arrived)."""
        return self.ch is not None and self.ch.nbytes <= PACK_MAX_BYTES

    def finish(self) -> list:
        """Wait for the header (if any) and post what follows; the works still to wait for. An
        error (the sender's status, a header off the declaration) is left in ``t.error``."""
        t = self.t
        if self.ch is not None:
            works = finish_cached_recv(t, self.ch, self.posted, self.api)
        elif not t.header:
            return self.posted
        else:
            self.posted[0].wait()
            read_header(t, self.api)
            works = post([m for m in [payload_msg(t)] if m is not None], False, self.api)
        if self.cache is not None and t.status == OK and t.payload is not None:
            self.cache.put(t, t.payload.shape, t.payload.dtype)
        return works

    def wait(self) -> torch.Tensor:
        """Complete the transfer; the received tensor.

        Raises:
            ShardkitError: the sender reported an error in its header, or the header differs
                from the declaration (both after every message of the transfer completed).
        """
        for w in self.finish():
            w.wait()
        if self.t.error is not None:
            raise self.t.error
        assert self.t.payload is not None  # an OK transfer holds its tensor
        return self.t.payload
