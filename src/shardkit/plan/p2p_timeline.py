"""A step table's time line with P2P transfers as their own resource, posted as the runner posts.

The dataflow simulator (:func:`~shardkit.pipeline_parallel.simulate.simulate_steps`) runs the
steps with free transfers. Here each cross-rank message (:func:`~shardkit.pipeline_parallel.
simulate.transfers`: an activation after ``F``, an input gradient after ``B`` / ``I``) takes
``x`` seconds on its directed link (sender rank -> receiver rank), apart from compute. What the
chunked runner does (:mod:`shardkit.pipeline_parallel._chunk_exec`, :mod:`~shardkit.
pipeline_parallel._mailbox`), and so what is modelled:

* a send is posted right after the step that computes its tensor and never blocks the sender
  (``isend``, waited for only at the end of the call): it overlaps the sender's next steps;
* a transfer moves only when both ends are posted (NCCL and gloo hand a message over to a
  posted receive; a hidden-state message is far above NCCL's buffered sizes), and the messages
  of one directed link move one at a time in the sender's order (one process group per link,
  one stream per rank pair and direction, FIFO pairing);
* receives from a neighbour are posted in the sender's order, one at a time, and a transfer
  starts at ``max(sent, posted, link free)``. When the receive is posted (``posting``):

  - ``"ahead"``: on NCCL with trusted shapes (the trainer's steps after its first: it passes a
    ``shape_key``, :class:`~shardkit.pipeline_parallel._transfer.ShapeTrust`) no receive reads
    its header on the host, so the host runs ahead of the GPU and every receive is on its link's
    stream long before the GPU reaches the step: ``posted = 0``. The planner's choice;
  - ``"need"``: on NCCL without trusted shapes (a first step) the host reads each header, so it
    posts a receive when the step needs it, after the previous step ended on the GPU;
  - ``"taken"``: gloo (``early`` in :mod:`~shardkit.pipeline_parallel._mailbox`): each
    neighbour's next receive is posted at the start and once the previous one was taken;
* a step starts when its rank's previous step ended and its inputs arrived; the call ends when
  every rank's last step and every transfer ended.

With ``x = 0`` the makespan is :func:`simulate_steps`' (tested). Units are the caller's (the
planner passes costs in units of the forward ``f``). Source: the runner's code cited above.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import ShardkitError
from ..pipeline_parallel.simulate import transfers
from ..pipeline_parallel.steps import Step, chunk_owner, global_chunk

__all__ = ["POSTINGS", "Timeline", "p2p_timeline"]

POSTINGS = ("ahead", "need", "taken")

Key = tuple[str, int, int]  # (kind, microbatch, global chunk) of a finished step


@dataclass(frozen=True)
class Timeline:
    """What :func:`p2p_timeline` found.

    Attributes:
        makespan: from the first step's start to the last step's or transfer's end.
        compute: per rank, the seconds its steps ran.
        moved: per directed link ``(src, dst)``, the number of messages moved (the table's
            :func:`~shardkit.pipeline_parallel.simulate.transfers`, unchanged by the timing).
        waited: per rank, the seconds it waited for a transfer after its message's sender had
            finished (the P2P time exposed on that rank).
    """

    makespan: float
    compute: tuple[float, ...]
    moved: dict[tuple[int, int], int]
    waited: tuple[float, ...]


def _producer(msg: tuple[str, int, int]) -> Key:
    """The finished step that makes ``msg`` (``("F" | "B", microbatch, receiving global chunk)``):
    the forward of chunk ``c - 1``, or the backward (``B`` or ``I``, ``"G"``) of chunk ``c + 1``."""
    kind, j, g = msg
    return ("F", j, g - 1) if kind == "F" else ("G", j, g + 1)


def p2p_timeline(
    table: Sequence[Sequence[Step]],
    *,
    placement: str,
    v: int,
    num_microbatches: int,
    costs: Mapping[str, float],
    x: float,
    posting: str = "ahead",
) -> Timeline:
    """Run ``table`` with step durations ``costs`` (``F``, ``B``, ``I``, ``W``) and ``x`` seconds
    per cross-rank transfer, receives posted ``"ahead"``, at ``"need"`` or once the previous was
    ``"taken"`` (the module docstring).

    Raises:
        ShardkitError: an unknown ``posting``; a rank waits for a step that never runs (a
            deadlocked table; the registry's tables are checked by :func:`simulate_steps` first).
    """
    if posting not in POSTINGS:
        raise ShardkitError(f"p2p_timeline: posting must be one of {POSTINGS}, got {posting!r}")
    p = len(table)
    rows = [[Step(*s) for s in row] for row in table]
    sent, _ = transfers(rows, placement=placement, v=v)
    queue = {link: list(msgs) for link, msgs in sent.items()}  # messages still to move, sender's order
    link_free = dict.fromkeys(queue, 0.0)
    posted = dict.fromkeys(queue, 0.0)  # "taken": when the next receive of the link was posted
    arrived: dict[tuple[str, int, int], float] = {}
    done: dict[Key, float] = {}
    pc, clock, busy, waited = [0] * p, [0.0] * p, [0.0] * p, [0.0] * p

    def end_of(key: Key) -> float | None:
        if key[0] != "G":
            return done.get(key)
        return done.get(("B", *key[1:]), done.get(("I", *key[1:])))

    def receive(r: int, msg: tuple[str, int, int], src: int) -> float | None:
        """Move the link's messages up to ``msg`` (the mailbox's loop); its arrival, or None."""
        link, host = (src, r), clock[r]
        while msg not in arrived:
            nxt = queue[link][0]
            ready = end_of(_producer(nxt))
            if ready is None:
                return None  # its sender has not computed it yet
            post = {"ahead": 0.0, "need": host, "taken": posted[link]}[posting]
            start = max(ready, post, link_free[link])
            arrived[nxt] = link_free[link] = start + x
            queue[link].pop(0)
            host = max(host, arrived[nxt])
            posted[link] = host  # "taken": the next receive is posted once this one was taken
        return arrived[msg]

    while any(pc[r] < len(rows[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pc[r] < len(rows[r]):
                s = rows[r][pc[r]]
                g = global_chunk(placement, r, s.chunk, p)
                needs: list[float | None] = []
                if s.kind == "W":
                    needs.append(done.get(("I", s.microbatch, g)))
                else:
                    if s.kind != "F":
                        needs.append(done.get(("F", s.microbatch, g)))
                    src_g = g - 1 if s.kind == "F" else g + 1
                    if 0 <= src_g < p * v:
                        msg = ("F" if s.kind == "F" else "B", s.microbatch, g)
                        src = chunk_owner(placement, src_g, p)[0]
                        ready = end_of(_producer(msg))
                        needs.append(ready if src == r else receive(r, msg, src))
                        if src != r and ready is not None and needs[-1] is not None:
                            waited[r] += max(0.0, needs[-1] - max(clock[r], ready))  # type: ignore[operator]
                if any(e is None for e in needs):
                    break
                start = max([clock[r], *(e for e in needs if e is not None)])
                clock[r] = start + costs[s.kind]
                busy[r] += costs[s.kind]
                done[(s.kind, s.microbatch, g)] = clock[r]
                pc[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: rows[r][pc[r]] for r in range(p) if pc[r] < len(rows[r])}
            raise ShardkitError(f"p2p_timeline: deadlock, blocked ranks and their next step: {stuck}")
    makespan = max([*clock, *link_free.values()])
    return Timeline(makespan, tuple(busy), {k: len(m) for k, m in sent.items()}, tuple(waited))
