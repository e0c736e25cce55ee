"""Cached shapes in the P2P engine (:mod:`._exchange`): a channel whose shape was negotiated
sends the header with a message of that shape, packed into one message when small.

A repeat of the cached shape (the common case: every microbatch of a run) sends the channel's
stored header bytes and is accepted by the receiver with one comparison against its own stored
header: no encoding, no decoding, no second buffer. Any other header (a new shape or dtype, an
error status) differs in some byte and is decoded, so a changed shape is always seen.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _wire
from ._negotiate import read_header
from ._transfer import Channel, Message, ShapeCache, Transfer, header_msg, payload_msg, post
from ._wire import HEADER_LEN, OK

__all__ = [
    "PACK_MAX_BYTES",
    "cached_send",
    "cached_recv",
    "post_cached_recv",
    "finish_cached_recv",
    "post_packed",
    "read_packed",
]

# Cached shapes up to this many payload bytes travel in one message, the header in front of the
# payload (one copy on the sending side, into a reused buffer; the receiver returns a view of what
# it received), cheaper below gloo's ~256 KiB latency/bandwidth crossover than a second message's
# latency; larger ones as two messages posted together (the payload itself, no copy).
PACK_MAX_BYTES = 256 * 1024
_HB = HEADER_LEN * 8  # header bytes; a multiple of 16, so the payload view after it is aligned


def cached_send(t: Transfer, ch: Channel, api: str, cache: ShapeCache) -> list:
    """Header, then a message of the cached shape (the payload, or a dummy plus the payload);
    packed into one message when the cached payload is small. A repeated shape is one ``cat``
    of the channel's stored header and the payload into the peer's reused send buffer
    (:meth:`ShapeCache.packed_buffer`: no header encoding, one copy, no allocation)."""
    x = t.payload
    assert x is not None  # a sender's transfer holds its tensor
    same = t.status == OK and x.dtype == ch.dtype and x.shape == ch.shape
    if ch.nbytes <= PACK_MAX_BYTES:
        buf = cache.packed_buffer(t, _HB + ch.nbytes)
        if same:
            torch.cat([_header(ch, t.device), x.reshape(-1).view(torch.uint8)], out=buf)
        else:
            buf[:_HB].view(torch.int64).copy_(_wire.encode(t.status, x.dtype, x.shape, t.device))
        msgs: list[Message] = [(t, True, buf, t.phase)]
    elif same:
        # The channel's stored header (the bytes an OK header of this shape encodes to): no encoding.
        t.hdr = _header(ch, t.device).view(torch.int64)
        msgs = [(t, True, t.hdr, t.phase), (t, True, x, t.phase)]
    else:
        msgs = [header_msg(t), (t, True, torch.empty(ch.shape, dtype=ch.dtype, device=t.device), t.phase)]
    if not same and (pay := payload_msg(t)) is not None:
        msgs.append(pay)
    works = post(msgs, False, api)
    if ch.nbytes <= PACK_MAX_BYTES:
        cache.hold_packed(t, msgs[0][2], works[0])
    return works


def _header(ch: Channel, device: torch.device) -> torch.Tensor:
    """The channel's stored header (uint8) on ``device``."""
    return ch.header if ch.device == device else ch.header.to(device)


def post_packed(t: Transfer, ch: Channel, api: str) -> tuple[torch.Tensor, Any]:
    """Post the one receive of a packed transfer (header + payload of the cached shape)."""
    buf = torch.empty(_HB + ch.nbytes, dtype=torch.uint8, device=t.device)
    return buf, post([(t, False, buf, t.phase)], False, api)[0]


def read_packed(t: Transfer, ch: Channel, buf: torch.Tensor, work, api: str) -> list:
    """Complete a packed receive: a header equal to the channel's stored one (the cached shape,
    status OK) is accepted by one comparison, without decoding; else :func:`_after_header`."""
    work.wait()
    hdr, body = buf.split_with_sizes((_HB, ch.nbytes))
    if _accepts(t, ch, hdr):
        t.payload = body.view(ch.dtype).view(ch.shape)
        return []
    t.hdr = hdr.view(torch.int64)
    return _after_header(t, ch, body.view(ch.dtype).view(ch.shape), [], api)


def cached_recv(t: Transfer, ch: Channel, api: str) -> list:
    """The mirror of :func:`cached_send`: header and a receive of the cached shape posted
    together (or one packed receive); the real payload after them only when the header
    announces another shape."""
    return finish_cached_recv(t, ch, post_cached_recv(t, ch, api), api)


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
    if _accepts(t, ch, t.hdr.view(torch.uint8)):
        t.payload = pre
        return works[1:]
    return _after_header(t, ch, pre, works[1:], api)


def _accepts(t: Transfer, ch: Channel, hdr: torch.Tensor) -> bool:
    """Whether a received header (uint8) announces the cached shape with status OK, for a receive
    that accepts the cached dtype: one comparison with the stored header, no decoding (a header
    that differs in any byte is decoded and judged by :func:`._negotiate.read_header`)."""
    return (t.dtype is None or t.dtype == ch.dtype) and ch.device == t.device and torch.equal(hdr, ch.header)


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
