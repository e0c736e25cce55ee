"""The messages of one rank's run of a :class:`~.steps.Step` table (:mod:`._chunk_exec`): which
step takes and gives which message, which link carries it, and the order receives are posted in.

A message is ``(kind, microbatch, receiving global chunk)``: ``"F"`` an activation, ``"B"`` an
input gradient. :func:`step_messages` says which message a step needs and which it produces;
:func:`link` which link (one process group on NCCL) carries a message between two neighbours;
:class:`Mailbox` posts the receives and sends of one call through a transport (the P2P engine in
:mod:`._chunk_exec`, or the recorder of the tests' stream model (``tests/harness/stream_model.py``),
which replays the same calls on a model of NCCL's streams: the posting order it checks is the
runner's own, by construction).

Receives from each neighbour are posted in the order the neighbour sends (no tags: messages pair
in FIFO order, :func:`.simulate.transfers`), one at a time: a receive is posted only when the
previous one from that neighbour has completed, so a changed shape (one more message, the real
payload after a dummy, :mod:`._packed`) never meets a receive posted for the next message. With
``early`` (gloo) the next receive from each neighbour is posted as soon as the previous one
completed (and at the start), so a sender's message moves while this rank computes: gloo hands a
send over only once the receive is posted (a rendezvous), which otherwise costs a round trip
on the critical path at every hand-over. Without ``early`` (NCCL) a receive is posted when the
step needs it: NCCL's receive is a kernel that waits on the GPU for its data, and one posted
early would hold GPU resources while this rank computes (not measured here: no GPU).
The tests' stream model (``tests/harness/stream_model.py``) checks both orders.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch.distributed as dist

from ..comm._group import GroupInfo, resolve_group
from ..errors import ShardkitError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "Message",
    "Transport",
    "Mailbox",
    "incoming",
    "link",
    "link_groups",
    "links",
    "links_error",
    "step_messages",
]

Message = tuple[str, int, int]  # (kind "F" | "B", microbatch, receiving global chunk)


def step_messages(kind: str, microbatch: int, chunk: int, num_chunks: int) -> tuple[Message | None, Message | None]:
    """``(needed, produced)`` of a step of ``kind`` on global ``chunk`` (pure): ``F`` needs chunk
    ``chunk - 1``'s activation and produces the next chunk's; ``B``/``I`` need the gradient of
    chunk ``chunk + 1``'s input and produce the previous chunk's; ``W`` neither. The ends of the
    pipeline take the data (``F`` of chunk 0) and the loss (``B``/``I`` of the last chunk)."""
    if kind == "W":
        return None, None
    if kind == "F":
        need, give = ("F", microbatch, chunk), ("F", microbatch, chunk + 1)
        return (need if chunk > 0 else None), (give if chunk < num_chunks - 1 else None)
    need, give = ("B", microbatch, chunk), ("B", microbatch, chunk - 1)
    return (need if chunk < num_chunks - 1 else None), (give if chunk > 0 else None)


def incoming(sent: dict[tuple[int, int], list[Message]], rank: int) -> dict[int, list[Message]]:
    """Per sending rank, the messages it sends ``rank``, in its order (pure), from ``sent``: the
    first result of :func:`.simulate.transfers` on the table."""
    return {q: list(msgs) for (q, dst), msgs in sent.items() if dst == rank}


def link(src: int, dst: int, p: int) -> tuple[str, int]:
    """The link a message from pipeline rank ``src`` to neighbour ``dst`` travels on (pure):
    ``(direction, colour)``.

    ``direction`` as the sender sees it: ``"next"`` from ``r`` to ``r + 1`` (mod ``p``),
    ``"prev"`` from ``r`` to ``r - 1``; with ``p = 2`` (both neighbours are one rank) ``"next"``
    from rank 0 to 1, ``"prev"`` back. ``colour`` tells apart the rank pairs ``{a, a + 1}``:
    ``a % 2``, and 2 for the pair ``{p - 1, 0}`` when ``p`` is odd (3 or more). Each link is one
    process group on NCCL (:func:`link_groups`): no two links of a group share a rank,
    so every stream of a group carries one rank pair's messages one way."""
    direction = "next" if (dst > src if p == 2 else dst == (src + 1) % p) else "prev"
    a = src if direction == "next" else dst  # the pair {a, a + 1}
    colour = 2 if (a == p - 1 and p % 2 == 1 and p > 2) else a % 2
    return direction, colour


def links(p: int) -> list[tuple[str, int]]:
    """Every link of a ``p``-rank pipeline (``p >= 2``), in one order (pure)."""
    return sorted({link(r, q, p) for r in range(p) for q in ((r + 1) % p, (r - 1) % p) if q != r})


def link_groups(g: GroupInfo, separate: bool, p: int | None = None) -> dict[tuple[str, int], GroupInfo]:
    """The process group of each link (:func:`links`) of the pipeline group ``g``
    (of ``p`` pipeline positions, default ``g.size``; tp-group stages: their number, the links
    then join stages and every group holds all of ``g``'s ranks).

    ``separate`` (NCCL, any backend but gloo): ``g`` for the first link and, for each other one,
    a new group of ``g``'s ranks (``dist.new_group(ranks, use_local_synchronization=True)``:
    collective over ``g``; 2 to 6 groups in all, by ``p``). NCCL runs a group's P2P between two
    ranks in order on one stream (on one stream per rank when the communicator is initialized
    eagerly), so a send could wait in front of a receive it depends on; no two links of a group
    share a rank, so each stream carries one rank pair's messages one way (the proof: the tests'
    stream model, ``tests/harness/stream_model.py``). Else ``g`` for every link: gloo pairs each
    direction of a rank pair on its own and never blocks a post. A group of one rank has no link."""
    p = g.size if p is None else p
    if p < 2:
        return {}
    names = links(p)
    if not separate:
        return dict.fromkeys(names, g)
    ranks = dist.get_process_group_ranks(g.pg)
    backend = dist.get_backend(g.pg)
    made = [g] + [
        resolve_group(dist.new_group(ranks, backend=backend, use_local_synchronization=True), "PipelineStage")
        for _ in names[1:]
    ]
    return dict(zip(names, made, strict=True))


def links_error(backend: str, eager: bool) -> str | None:
    """Why :func:`link_groups` cannot build a pipeline's link groups, or None (pure).

    On NCCL with an eagerly initialized default group (``init_process_group(device_id=...)``)
    ``new_group`` splits the default communicator (``ncclCommSplit``), which every rank of the
    default group must join, so a group built by the pipeline's ranks alone would wait for the
    others; lazily initialized groups (the default, and ``shardkit train``'s) have no split."""
    if backend.lower() != "gloo" and eager:
        return (
            "pipeline schedules on NCCL build one process group per pipeline link from the pipeline's ranks "
            "alone, which an eagerly initialized default group (init_process_group(device_id=...)) cannot do "
            "(ncclCommSplit needs every rank); initialize it without device_id"
        )
    return None


class Transport(Protocol):
    """What :class:`Mailbox` posts messages through."""

    def send(self, msg: Message, dst: int, tensor: Any) -> Any:
        """Post the send of ``msg`` to rank ``dst``; a handle with ``is_completed()`` and ``wait()``."""
        ...

    def post(self, msg: Message, src: int) -> Any:
        """Post the receive of ``msg`` from rank ``src``; a handle for :meth:`receive`."""
        ...

    def receive(self, handle: Any) -> Any:
        """Complete a posted receive (wait for it); its tensor."""
        ...


class Mailbox:
    """The messages of one rank in one call (see the module docstring).

    Args:
        rank: this pipeline rank.
        owner: global chunk -> the rank holding it.
        incoming: per sending rank, the messages it sends this rank, in its order.
        transport: posts the messages.
        early: post each neighbour's next receive as soon as the previous one completed.
    """

    def __init__(
        self, rank: int, owner, incoming: Mapping[int, Sequence[Message]], transport: Transport, early: bool
    ) -> None:
        self.rank, self.owner, self.transport, self.early = rank, owner, transport, early
        self.incoming = {q: list(msgs) for q, msgs in sorted(incoming.items())}  # what is still to post
        self.posted: dict[int, tuple[Message, Any]] = {}  # sending rank -> its posted receive
        self.inbox: dict[Message, Any] = {}  # arrived (or handed over locally), not yet taken
        self.sending: list = []
        if early:
            for q in self.incoming:
                self._post_next(q)

    def _post_next(self, src: int) -> None:
        if self.incoming[src] and src not in self.posted:
            msg = self.incoming[src].pop(0)
            self.posted[src] = (msg, self.transport.post(msg, src))

    def deliver(self, msg: Message, tensor: Any) -> None:
        """Hand ``tensor`` to the chunk ``msg`` names: locally, or a posted send to its rank."""
        dst = self.owner(msg[2])
        if dst == self.rank:
            self.inbox[msg] = tensor
            return
        work = self.transport.send(msg, dst, tensor)
        self.sending = [w for w in self.sending if not w.is_completed()] + [work]

    def take(self, msg: Message) -> Any:
        """The tensor ``msg`` names: receives from the rank that produces it (the holder of chunk
        ``c - 1`` for an activation of chunk ``c``, ``c + 1`` for a gradient), in that rank's
        order, until ``msg`` came (the others wait in the inbox)."""
        src = self.owner(msg[2] - 1 if msg[0] == "F" else msg[2] + 1)
        while msg not in self.inbox:
            if src == self.rank or not (self.incoming.get(src) or src in self.posted):
                raise ShardkitError(f"run_schedule: rank {self.rank} waits for {msg} that no step produces")
            self._post_next(src)
            got, handle = self.posted.pop(src)
            self.inbox[got] = self.transport.receive(handle)
            if self.early:
                self._post_next(src)
        return self.inbox.pop(msg)

    def finish(self) -> None:
        """Wait for this call's sends (every receive was taken: the table consumes each message)."""
        for work in self.sending:
            work.wait()
