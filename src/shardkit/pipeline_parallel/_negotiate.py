"""The check mode's hellos and the header reading of the P2P engine (:mod:`._exchange`).

With checks on, the header is replaced by a hello each way (the sender's header out, the
receiver's declaration back, both with the author's role and phase), exchanged and checked on
both ends before the payload: every error is judged from both hellos, so both ends raise the
same text and no payload moves.
"""

from __future__ import annotations

import torch

from ..errors import RankMismatchError, ShardkitError
from . import _wire
from ._transfer import Transfer
from ._wire import HEADER_LEN, HELLO_LEN, OK

__all__ = ["hello_msgs", "settle", "read_header"]


def hello_msgs(t: Transfer, api: str) -> list:
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


def settle(t: Transfer, api: str) -> None:
    """Checks on, both hellos exchanged: a call past the pipeline's end, a misuse or a declaration
    error (the same on both ends, no payload follows), else the receiver reads the sender's header."""
    source = f"stage {t.peer} of {t.g.size}"
    assert t.hello_in is not None and t.hello_out is not None  # both exchanged by now
    peer = _wire.decode_hello(t.hello_in, api, source)
    mine = _wire.decode_hello(t.hello_out, api, t.where())
    error = _past_end(t, mine, peer) or _misuse(t, peer, api) or _declarations(t, mine, peer)
    if error is not None:
        t.error, t.status = error, _wire.MISUSE
        return
    if not t.send:
        t.hdr = t.hello_in[:HEADER_LEN]
        read_header(t, api)


def read_header(t: Transfer, api: str) -> None:
    """Decode a received header; set the payload buffer, or the error to raise later."""
    source = f"stage {t.peer} of {t.g.size}"
    assert t.hdr is not None  # received by now
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
    assert meta.shape is not None  # an OK header describes its payload
    t.payload = torch.empty(meta.shape, dtype=meta.dtype, device=t.device)
