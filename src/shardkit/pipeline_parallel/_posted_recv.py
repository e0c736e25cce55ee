"""One negotiated receive of the P2P engine, posted now and completed later (the chunked
runner's receives, :mod:`._mailbox`): what :func:`._p2p_call.run` does for one receive with a
:class:`~._transfer.ShapeCache` (checks off, one group, ordered mode), cut in two.

Posting: with a cached shape, the receive(s) of :func:`._packed.post_cached_recv` (one packed
message, or the header and a message of the cached shape); without one, the header receive.
Completing: the rest of the same transfer, exactly as the engine runs it (the header is compared
or decoded, a changed shape receives the dummy and then the real payload, the cache is updated
only from an ``OK`` header), so the messages, their order and the ledger are the engine's.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm._group import GroupInfo
from ._negotiate import read_header
from ._p2p_call import _device, _peer
from ._packed import finish_cached_recv, post_cached_recv
from ._transfer import ShapeCache, Transfer, header_msg, payload_msg, post
from ._wire import OK

__all__ = ["PostedRecv"]


class PostedRecv:
    """A receive from the ``towards`` neighbour of ``g`` (``loop=True``), posted at construction.

    Args:
        api: the public name it acts as (``recv_forward`` / ``recv_backward``), for the ledger
            and error messages.
        g: the group.
        towards: ``"next"`` or ``"prev"``: the neighbour it receives from.
        phase: ledger phase (``"forward"`` / ``"backward"``).
        cache: the channel's negotiated shapes (both ends pass the same key's cache).
        decl: None, or the ``(shape, dtype)`` the receiver declares: a header announcing another
            raises (after the payload arrived; the check mode's static transfers).
    """

    def __init__(
        self, api: str, g: GroupInfo, towards: str, phase: str, cache: ShapeCache, decl: tuple | None = None
    ) -> None:
        self.api, self.cache = api, cache
        device = _device(None, g, api)
        shape, dtype = decl or (None, None)
        self.t = Transfer(False, towards, 0, g, _peer(g, towards, True, api), phase, device, shape, dtype, True)
        self.ch = cache.get(self.t)
        self.posted: Any = (
            post([header_msg(self.t)], False, api) if self.ch is None else post_cached_recv(self.t, self.ch, api)
        )

    def wait(self) -> torch.Tensor:
        """Complete the transfer; the received tensor.

        Raises:
            ShardkitError: the sender reported an error in its header (both ends raise it, after
                every message of the transfer completed).
        """
        t = self.t
        if self.ch is None:
            self.posted[0].wait()
            read_header(t, self.api)
            works = post([m for m in [payload_msg(t)] if m is not None], False, self.api)
        else:
            works = finish_cached_recv(t, self.ch, self.posted, self.api)
        if t.status == OK and t.payload is not None:  # both ends record an OK header's shape
            self.cache.put(t, t.payload.shape, t.payload.dtype)
        for w in works:
            w.wait()
        if t.error is not None:
            raise t.error
        assert t.payload is not None  # an OK transfer holds its tensor
        return t.payload
