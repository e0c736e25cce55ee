"""The one transport of pipeline messages: one message to or from a neighbour on a process group,
posted by the runner (:class:`Links`, a :class:`~._mailbox.Transport` of a
:class:`~.steps.Step` table) and by the public one-message P2P calls of :mod:`.p2p` alike
(:func:`send_message`, :func:`recv_message`; checks off). A message has one
of three forms.

* Negotiated (the default): a header and the payload, the shape cached per channel on both ends
  (:class:`~._transfer.ShapeCache`; the runner keeps one per (kind, receiving chunk)): a repeated
  shape costs no round trip (:mod:`._packed`).
* Static (a declared ``(shape, dtype)``; the runner's ``boundary_shapes``): no header, one
  ``isend`` / ``irecv`` each end. Boundary ``b`` lies between global chunks ``b`` and ``b + 1``:
  an activation for chunk ``c`` crosses ``c - 1``, the gradient for chunk ``c`` (from ``c + 1``)
  crosses ``c``; a gradient has its activation's shape.
* Checked (:func:`~shardkit.comm.checks` on, runner): every message carries a header that the
  receiver decodes and judges on the host (no cached or trusted shape), a static one too, so a
  tensor that does not match its declaration, or a receiver whose declaration differs from the
  sent header, raises on both ends after the message completed. The public calls say hellos
  instead (:mod:`._negotiate`); a hello waits for the peer's, which a send of a table cannot (its
  sends must not block), and what a hello tells about the peer's call (its role and direction)
  is fixed by the table every rank agreed on before the first step (every call under checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..comm.checks import checks_enabled
from ..errors import ShardkitError, ShardkitTypeError
from . import _wire
from ._exchange import P2PWork, exchange
from ._mailbox import Message, link
from ._packed import Recv, send_repeat, send_transfer
from ._transfer import ShapeCache, Transfer, post_one

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..comm._group import GroupInfo
    from .stage import PipelineStage

__all__ = ["Links", "Posted", "boundary_decls", "peer", "recv_device", "recv_message", "send_message"]

Decl = tuple[tuple[int, ...] | None, torch.dtype | None]  # (shape, dtype); None: not declared


def peer_or_none(g: GroupInfo, towards: str, loop: bool) -> int | None:
    """Group rank of the next or previous stage; None past the pipeline's end (or with ``loop``
    in a group of one)."""
    q = g.rank + (1 if towards == "next" else -1)
    if loop:
        return q % g.size if g.size > 1 else None
    return q if 0 <= q < g.size else None


def peer(g: GroupInfo, towards: str, loop: bool, api: str) -> int:
    """Group rank of the next or previous stage.

    Raises:
        ShardkitError: there is none (past the pipeline's end without ``loop``, or one stage)."""
    q = peer_or_none(g, towards, loop)
    if q is not None:
        return q
    if loop:
        raise ShardkitError(f"{api}: loop=True needs at least 2 pipeline stages, the group has {g.size}")
    which, other = ("last", "next") if towards == "next" else ("first", "previous")
    raise ShardkitError(
        f"{api}: stage {g.rank} is the {which} of {g.size} pipeline stages and has no {other} stage "
        f"(pass loop=True to connect the last stage to the first)"
    )


def recv_device(device, g: GroupInfo, api: str) -> torch.device:
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


def check_own_tensor(t: Transfer, api: str) -> None:
    """The sender's checks of its own tensor: against its declaration, and that a header can
    describe it. Set as the transfer's status and error: the header tells the receiver, both
    raise once the message completed (without a header the sender raises before sending)."""
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


class Posted(P2PWork):
    """The handle of one message's posted works (and the received tensor, if any): the public
    calls' :class:`~._exchange.P2PWork` and a :class:`~._mailbox.Mailbox` send handle."""

    def __init__(self, works: list, received: torch.Tensor | None = None) -> None:  # no transfers to reduce
        self._works, self._received, self._done = works, received, False

    def wait(self) -> torch.Tensor | None:
        self.complete()
        return self._received


def send_message(
    api: str, g: GroupInfo, towards: str, to: int, phase: str, x: torch.Tensor, decl: Decl, cache: ShapeCache | None
) -> list:
    """Post one message of ``x`` to group rank ``to`` (checks off); its works.

    Static (``decl``'s shape set): the payload alone. Negotiated: a repeat of ``cache``'s shape
    is one packed message (:func:`._packed.send_repeat`, no :class:`Transfer`: each step of the
    general path costs host time on every microbatch), another shape a header and the payload,
    the cache updated from an ``OK`` header (the receiver updates its copy from the same one).

    Raises:
        ShardkitError: ``x`` does not match ``decl`` (static: before anything is sent; negotiated:
            after the header told the receiver, which raises too) or has no header encoding.
    """
    shape, dtype = decl
    x = x.detach().contiguous()
    if shape is not None:
        t = Transfer(True, towards, 0, g, to, phase, x.device, shape, dtype, False, x)
        check_own_tensor(t, api)  # no header to carry an error: raised before anything is sent
        if t.error is not None:
            raise t.error
        return [post_one(g, to, True, x, phase, api)] if x.numel() > 0 else []
    ch = cache.lookup(g.pg, True, to) if cache is not None else None
    if ch is not None and (x.dtype, x.shape, x.device) == (ch.dtype, ch.shape, ch.device) and dtype in (None, x.dtype):
        assert cache is not None  # the cached shape came from it
        return send_repeat(g, to, phase, x, ch, cache, api)  # the sender's checks passed on this shape before
    t = Transfer(True, towards, 0, g, to, phase, x.device, None, dtype, True, x)
    check_own_tensor(t, api)
    works = send_transfer(t, cache, api)
    if t.error is not None:
        for w in works:
            w.wait()  # keep the channel in step, then raise (the receiver raises too: the header told it)
        raise t.error
    return works


def recv_message(
    api: str,
    g: GroupInfo,
    towards: str,
    src: int,
    phase: str,
    decl: Decl,
    cache: ShapeCache | None,
    device,
    static: bool,
) -> Recv:
    """Post the receive of one message from group rank ``src`` (the ``towards`` neighbour):
    ``static`` (``decl`` a shape and dtype): the payload alone; else negotiated through ``cache``
    (None: a header every time), ``decl``'s dtype and shape (if any) checked against the header.
    Complete it with :meth:`._packed.Recv.wait` (or ``finish``)."""
    t = Transfer(False, towards, 0, g, src, phase, device, decl[0], decl[1], not static)
    return Recv(t, None if static else cache, api)


def boundary_decls(shapes, boundaries: int, op: str) -> list[Decl] | None:
    """``boundary_shapes`` checked (pure): None, or ``boundaries`` pairs ``(shape, dtype)``.

    Raises:
        ShardkitError: not ``boundaries`` pairs of a sequence of ints and a ``torch.dtype``.
    """
    if shapes is None:
        return None
    try:
        decls: list[Decl] = [(tuple(int(d) for d in shape), dtype) for shape, dtype in shapes]
    except (TypeError, ValueError):
        raise ShardkitError(
            f"{op}: boundary_shapes must be {boundaries} pairs (shape, dtype), got {shapes!r}"
        ) from None
    if len(decls) != boundaries or not all(isinstance(dt, torch.dtype) for _, dt in decls):
        raise ShardkitError(f"{op}: boundary_shapes must be {boundaries} pairs (shape, torch.dtype), got {shapes!r}")
    return decls


class Links:
    """The runner's :class:`~._mailbox.Transport` on one-rank stages (see the module docstring).

    Args:
        stage: the rank's stage (its ``links``, ``shape_trust``, placement).
        caches: ``(kind, receiving chunk) -> ShapeCache``, kept between calls by the stage.
        decls: per boundary ``(shape, dtype)``, or None (negotiated).
    """

    def __init__(self, stage: PipelineStage, caches: dict, decls: Sequence[Decl] | None = None) -> None:
        self.stage, self.caches, self.decls = stage, caches, decls
        self.checked = checks_enabled()  # one mode for the whole call (agreed with the table)

    def cache(self, msg: Message) -> ShapeCache:
        if self.checked:  # every header read and judged: nothing cached
            return ShapeCache()
        return self.caches.setdefault(msg[::2], ShapeCache(self.stage.shape_trust))

    def decl(self, msg: Message) -> Decl:
        if self.decls is None:
            return None, None
        return self.decls[msg[2] - 1 if msg[0] == "F" else msg[2]]

    def send(self, msg: Message, dst: int, tensor: torch.Tensor) -> P2PWork:
        st = self.stage
        name = link(st.rank, dst, st.p)
        api, phase = ("send_forward", "forward") if msg[0] == "F" else ("send_backward", "backward")
        g, towards = st.links[name], name[0]
        to = peer(g, towards, True, api)
        if not self.checked:
            return Posted(send_message(api, g, towards, to, phase, tensor, self.decl(msg), self.cache(msg)))
        x = tensor.detach().contiguous()
        shape, dtype = self.decl(msg)
        t = Transfer(True, towards, 0, g, to, phase, x.device, shape, dtype, True, x)
        check_own_tensor(t, api)  # a broken declaration travels in the header: both ends raise
        return exchange([t], api, False, False, "mean")

    def post(self, msg: Message, src: int) -> Recv:
        st = self.stage
        name = link(src, st.rank, st.p)  # the sender's link: this end receives from the other side
        towards = "prev" if name[0] == "next" else "next"
        api, phase = ("recv_forward", "forward") if msg[0] == "F" else ("recv_backward", "backward")
        g, decl = st.links[name], self.decl(msg)
        static = decl[0] is not None and not self.checked  # checks: every message has a header
        src, where = peer(g, towards, True, api), recv_device(None, g, api)
        return recv_message(api, g, towards, src, phase, decl, self.cache(msg), where, static)

    def receive(self, handle: Recv) -> torch.Tensor:
        return handle.wait()
