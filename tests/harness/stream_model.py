"""A model of NCCL's point-to-point streams, run on the chunked runner's own posting order: the
check that the runner of :mod:`._chunk_exec` cannot hang on NCCL (not run on a GPU here).
A test harness: only the tests run it (the runner never consults the model), so it lives beside
them, not in the installed package; relative names (``._mailbox``) are of
``shardkit.pipeline_parallel``.

The posting order. :func:`posting_order` runs each rank's row of a table through the runner's
:class:`~._mailbox.Mailbox` (the object that posts every message of a real run, with the same
:func:`~._mailbox.step_messages`, :func:`~._mailbox.incoming` and :func:`~._mailbox.link`) on a
recording transport: per rank, the events ``("send", msg, peer, group)``, ``("post", msg,
peer, group)`` (a receive posted), ``("wait", msg)`` (the host waits for that receive) and
``("end",)`` (the host waits for its sends). The order does not depend on timing: the mailbox
never polls.

The model (:func:`check_streams`). Each rank has streams that run its operations in posting
order; a send and a receive complete together when each is at the head of its stream and they
name each other (no buffering: a send waits for its receive, whatever its size); the host
blocks only at ``wait`` and ``end``. The streams, by ``granularity``:

* ``"pair"``: one per process group and rank pair (a single ``isend``/``irecv`` of
  ProcessGroupNCCL runs on the communicator and stream of its rank pair);
* ``"rank"``: one per process group and rank (ProcessGroupNCCL with an eagerly initialized
  communicator runs every P2P of the group on it, serialized);
* ``"gloo"``: one per process group, rank pair and direction (gloo matches each direction of a
  pair on its own and never blocks a post).

A pairing of two different messages is reported too (FIFO pairing without tags would mix
tensors).

What it shows (tests/pipeline_parallel/test_stream_model.py), for every table of
:data:`~.tables.SCHEDULES` with ``p`` in 2..8, ``v`` in 1..4 and ``m`` in ``{p, 2p, 2p + 1}``:
the runner's NCCL order (receives posted when needed, one group per link,
:func:`~._mailbox.link_groups`) runs to its end under ``"pair"`` and ``"rank"``, and its gloo
order (receives posted early, one group) under ``"gloo"``; with one group on NCCL the same check
finds deadlocks (a send to a neighbour waiting in front of a receive from it).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel._mailbox import Mailbox, Message, incoming, link, step_messages
from shardkit.pipeline_parallel.simulate import transfers
from shardkit.pipeline_parallel.steps import chunk_owner, global_chunk

if TYPE_CHECKING:
    from shardkit.pipeline_parallel.steps import Table

__all__ = ["Event", "posting_order", "tp_posting_order", "check_streams"]

Event = tuple  # ("send" | "post", msg, peer, group) | ("wait", msg) | ("end",)


class _Sent:
    """A recorded send's handle: complete as far as the mailbox can tell (the model decides)."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _Recorder:
    """A :class:`~._mailbox.Transport` that records one rank's events."""

    def __init__(self, rank: int, p: int, shared: bool, events: list[Event]) -> None:
        self.rank, self.p, self.shared, self.events = rank, p, shared, events

    def group(self, src: int, dst: int) -> tuple[str, int]:
        """The link's group, as :func:`~._mailbox.link_groups` gives it (one for all: ``shared``)."""
        return ("shared", 0) if self.shared else link(src, dst, self.p)

    def send(self, msg: Message, dst: int, tensor: Any) -> _Sent:
        self.events.append(("send", msg, dst, self.group(self.rank, dst)))
        return _Sent()

    def post(self, msg: Message, src: int) -> Message:
        self.events.append(("post", msg, src, self.group(src, self.rank)))
        return msg

    def receive(self, handle: Message) -> None:
        self.events.append(("wait", handle))


def posting_order(table: Table, *, placement: str, v: int, early: bool, shared: bool = False) -> list[list[Event]]:
    """Per rank, the events of the runner's mailbox on ``table`` (pure).

    Args:
        table: ``p`` rows of :class:`~.steps.Step`.
        placement: ``"looped"`` or ``"v"``.
        v: chunks per rank.
        early: receives posted early (the runner on gloo) or when needed (NCCL).
        shared: one process group for every link (the runner on gloo) instead of one per
            :func:`~._mailbox.link` (on NCCL).
    """
    p = len(table)

    def owner(chunk: int) -> int:
        return chunk_owner(placement, chunk, p)[0]

    sent, _ = transfers(table, placement=placement, v=v)
    out: list[list[Event]] = []
    for r, row in enumerate(table):
        events: list[Event] = []
        mail = Mailbox(r, owner, incoming(sent, r), _Recorder(r, p, shared, events), early)
        for s in row:
            need, give = step_messages(s[0], s[1], global_chunk(placement, r, s[2], p), p * v)
            if need is not None:
                mail.take(need)
            if give is not None:
                mail.deliver(give, None)
        mail.finish()
        out.append([*events, ("end",)])
    return out


def tp_posting_order(stage_events: list[list[Event]], stage_ranks: list[list[int]]) -> list[list[Event]]:
    """Per rank of a pipeline of tp-group stages, the events of the runner's reshard transport
    (:mod:`._stage_links`), from :func:`posting_order` of its stages (``early=False``) (pure).

    Rank ``i`` of stage ``s`` (``stage_ranks[s]``, leader first) expands each event of ``s``:

    * a send to stage ``b``: the header from leader to leader, then a piece to every rank of
      ``b`` (every rank pair: a superset of any layout's piece plan), on the link's group;
    * a wait for a message from stage ``a`` (received whole when the step takes it): the
      leader posts and waits for the header, broadcasts it in the stage (a send from the
      leader on the stage's tp group to each rank, which waits for it), then every rank posts
      and waits for a piece from every rank of ``a`` and the leader broadcasts the payload;
    * the stage's ``post`` events vanish (posted when taken), ``end`` stays.
    """
    out: list[list[Event]] = [[] for _ in range(sum(len(r) for r in stage_ranks))]
    for s, events in enumerate(stage_events):
        ranks = stage_ranks[s]
        src_of: dict[Message, tuple[int, Any]] = {}
        for k, me in enumerate(ranks):
            ev_out = out[me]
            for ev in events:
                if ev[0] == "send":
                    _, msg, b, group = ev
                    if k == 0:
                        ev_out.append(("send", ("H", msg), stage_ranks[b][0], group))
                    ev_out += [("send", ("P", msg, me, j), j, group) for j in stage_ranks[b]]
                elif ev[0] == "post":
                    src_of[ev[1]] = (ev[2], ev[3])
                elif ev[0] == "wait":
                    msg = ev[1]
                    a, group = src_of[msg]
                    for kind in ("H", "P"):
                        if kind == "H" and k == 0:
                            ev_out += [("post", ("H", msg), stage_ranks[a][0], group), ("wait", ("H", msg))]
                        if kind == "P":
                            for i in stage_ranks[a]:
                                ev_out += [("post", ("P", msg, i, me), i, group), ("wait", ("P", msg, i, me))]
                        tp = ("tp", s)  # the broadcast of the header, then of the payload
                        if k == 0:
                            ev_out += [("send", ("B" + kind, msg, j), j, tp) for j in ranks[1:]]
                        else:
                            ev_out += [("post", ("B" + kind, msg, me), ranks[0], tp), ("wait", ("B" + kind, msg, me))]
                else:
                    ev_out.append(ev)
    return out


def check_streams(events: list[list[Event]], granularity: str = "pair") -> str | None:
    """Run ``events`` (:func:`posting_order`) on the stream model of the module docstring.

    Args:
        events: per rank, its events in posting order.
        granularity: ``"pair"``, ``"rank"`` or ``"gloo"`` (the module docstring).

    Returns:
        None when every rank reaches its end with every stream empty; else the first wrong
        pairing, or the deadlock: each unfinished rank's next event and its streams' heads.
    """
    if granularity not in ("pair", "rank", "gloo"):
        raise ShardkitError(f"check_streams: granularity must be 'pair', 'rank' or 'gloo', got {granularity!r}")
    p = len(events)
    streams: dict[tuple, deque] = {}
    pc, unsent = [0] * p, [0] * p
    arrived: list[set[Message]] = [set() for _ in range(p)]

    def key(rank: int, peer: int, group: tuple, kind: str) -> tuple:
        if granularity == "gloo":
            return (group, rank, peer, kind)
        return (group, rank, peer) if granularity == "pair" else (group, rank)

    moved = True
    while moved:
        moved = False
        for r in range(p):  # each host posts until it waits
            while pc[r] < len(events[r]):
                ev = events[r][pc[r]]
                if ev[0] in ("send", "post"):
                    streams.setdefault(key(r, ev[2], ev[3], ev[0]), deque()).append((ev[0], ev[1], r, ev[2]))
                    unsent[r] += ev[0] == "send"
                elif (ev[0] == "wait" and ev[1] not in arrived[r]) or (ev[0] == "end" and unsent[r]):
                    break
                pc[r] += 1
                moved = True
        for k, q in streams.items():  # each send at a head meets its receive at the peer's head
            if not q or q[0][0] != "send":
                continue
            _, msg, r, peer = q[0]
            other = streams.get(key(peer, r, k[0], "post"))
            if not other or other[0][0] != "post" or other[0][3] != r:
                continue
            if other[0][1] != msg:
                return f"wrong pairing: rank {r} sends {msg} to rank {peer}, which receives it as {other[0][1]}"
            q.popleft()
            other.popleft()
            arrived[peer].add(msg)
            unsent[r] -= 1
            moved = True
    if all(pc[r] == len(events[r]) for r in range(p)) and not any(streams.values()):
        return None
    blocked = {r: events[r][pc[r]] for r in range(p) if pc[r] < len(events[r])}
    heads = {k: q[0][:2] for k, q in streams.items() if q}
    return f"deadlock: ranks waiting at {blocked}; stream heads {heads}"
