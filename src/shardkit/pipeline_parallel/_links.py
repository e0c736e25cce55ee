"""The chunked runner's transport (:class:`~._mailbox.Transport`): one message of a
:class:`~.steps.Step` table on the process group of its link, in one of three forms.

* Negotiated (the default): a header and the payload, the shape cached per (kind, receiving
  chunk) on both ends (:class:`~._transfer.ShapeCache`, :func:`._p2p_call.run` and
  :class:`~._posted_recv.PostedRecv`): a repeated shape costs no round trip.
* Static (``boundary_shapes``): the declared ``(shape, dtype)`` of the boundary the message
  crosses, no header: one ``isend`` / ``irecv`` each end. Boundary ``b`` lies between global
  chunks ``b`` and ``b + 1``: an activation for chunk ``c`` crosses ``c - 1``, the gradient
  for chunk ``c`` (from ``c + 1``) crosses ``c``; a gradient has its activation's shape.
* Checked (:func:`~shardkit.comm.checks` on): every message carries a header that the receiver
  decodes and judges on the host (no cached or trusted shape), a static one too, so a tensor
  that does not match its declaration, or a receiver whose declaration differs from the sent
  header, raises on both ends after the message completed (the header carries the sender's
  status). This replaces the P2P calls' hellos: a hello waits for the peer's, which a send of a
  chunked table cannot (its sends must not block), and what a hello tells about the peer's call
  (its role and direction) is fixed here by the table every rank agreed on before the first
  step (:func:`._chunk_exec.run_chunked`, every call under checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..comm import ledger
from ..comm._compat import irecv
from ..comm.checks import checks_enabled
from ..errors import ShardkitError
from ._exchange import exchange
from ._mailbox import Message, link
from ._p2p_call import _check_own_tensor, _device, _peer, run
from ._posted_recv import PostedRecv
from ._transfer import ShapeCache, Transfer

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..comm._group import GroupInfo
    from .stage import PipelineStage

__all__ = ["Links", "StaticRecv", "boundary_decls"]

Decl = tuple[tuple[int, ...], torch.dtype]


def boundary_decls(shapes, boundaries: int, op: str) -> list[Decl] | None:
    """``boundary_shapes`` checked (pure): None, or ``boundaries`` pairs ``(shape, dtype)``.

    Raises:
        ShardkitError: not ``boundaries`` pairs of a sequence of ints and a ``torch.dtype``.
    """
    if shapes is None:
        return None
    try:
        decls = [(tuple(int(d) for d in shape), dtype) for shape, dtype in shapes]
    except (TypeError, ValueError):
        raise ShardkitError(
            f"{op}: boundary_shapes must be {boundaries} pairs (shape, dtype), got {shapes!r}"
        ) from None
    if len(decls) != boundaries or not all(isinstance(dt, torch.dtype) for _, dt in decls):
        raise ShardkitError(f"{op}: boundary_shapes must be {boundaries} pairs (shape, torch.dtype), got {shapes!r}")
    return decls


class StaticRecv:
    """A receive of a declared shape (no header), posted at construction; :meth:`wait` returns it."""

    def __init__(self, api: str, g: GroupInfo, towards: str, phase: str, decl: Decl) -> None:
        peer = _peer(g, towards, True, api)
        self.buf = torch.empty(decl[0], dtype=decl[1], device=_device(None, g, api))
        self.work = None
        if self.buf.numel() > 0:
            b = self.buf
            ledger.record("recv", api, phase, g.size, 0, b.nbytes, pg=g.pg, shape=b.shape, peer=peer, dtype=b.dtype)
            self.work = irecv(b, g.pg, peer)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.buf


class Links:
    """The P2P engine as :class:`~._mailbox.Transport` (see the module docstring).

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

    def decl(self, msg: Message) -> Decl | None:
        if self.decls is None:
            return None
        return self.decls[msg[2] - 1 if msg[0] == "F" else msg[2]]

    def send(self, msg: Message, dst: int, tensor: torch.Tensor):
        st = self.stage
        name = link(st.rank, dst, st.p)
        api, phase = ("send_forward", "forward") if msg[0] == "F" else ("send_backward", "backward")
        shape, dtype = self.decl(msg) or (None, None)
        g, towards = st.links[name], name[0]
        if not self.checked:
            cache = self.cache(msg)
            return run(api, g.pg, tensor, [(towards, phase)], [], shape, dtype, None, True, False, True, "mean", cache)
        x = tensor.detach().contiguous()
        t = Transfer(True, towards, 0, g, _peer(g, towards, True, api), phase, x.device, shape, dtype, True, x)
        _check_own_tensor(t, api)  # a broken declaration travels in the header: both ends raise
        return exchange([t], api, False, False, "mean")

    def post(self, msg: Message, src: int) -> PostedRecv | StaticRecv:
        st = self.stage
        name = link(src, st.rank, st.p)  # the sender's link: this end receives from the other side
        towards = "prev" if name[0] == "next" else "next"
        api, phase = ("recv_forward", "forward") if msg[0] == "F" else ("recv_backward", "backward")
        decl = self.decl(msg)
        if decl is not None and not self.checked:
            return StaticRecv(api, st.links[name], towards, phase, decl)
        return PostedRecv(api, st.links[name], towards, phase, self.cache(msg), decl)

    def receive(self, handle: PostedRecv | StaticRecv) -> torch.Tensor:
        return handle.wait()
