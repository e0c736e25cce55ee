"""Execute every rank's row of a :class:`~.steps.Step` table with data dependencies.

The dataflow model (sends never block, transfers take no time) is the one the schedules'
sources draw their time lines in (Narayanan et al., SC 2021, fig. 4; Qi et al., ICLR 2024,
fig. 3). Each rank runs its row in order; a step starts when its rank is free and its inputs
exist:

* ``F`` of chunk ``c`` on microbatch ``j`` needs ``F`` of chunk ``c - 1`` on ``j`` (whichever
  rank holds it);
* ``B`` / ``I`` of chunk ``c`` on ``j`` needs this chunk's ``F`` on ``j`` and the ``B`` / ``I``
  of chunk ``c + 1`` on ``j`` (the last chunk starts from the loss);
* ``W`` needs this chunk's ``I`` on ``j``.

A microbatch-chunk is *in flight* on its rank from the start of its ``F`` until its ``B`` or
``W`` has run (its activations are stored). It is the one simulator: the one runner checks
every table with it, one-chunk tables too (the blocking-P2P simulator of the former one-chunk
runner is gone; :func:`simulate` keeps its name for one release).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .steps import KINDS, Step, chunk_owner, global_chunk, lift

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from .schedules import Action

__all__ = ["Report", "simulate_steps", "UNIT_COSTS", "transfers", "fifo_mismatches", "simulate", "SimResult"]

UNIT_COSTS = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}  # B = I + W, the zero-bubble paper's equal-cost case


@dataclass(frozen=True)
class Report:
    """What :func:`simulate_steps` found.

    ``error`` names the first structural problem, dependency violation or deadlock (else
    None); ``makespan`` (cost units), per-rank ``busy`` time and ``peak`` in-flight
    microbatch-chunks per rank describe the run (``makespan``/``busy`` are 0 on an error found
    before running).
    """

    makespan: float
    busy: tuple[float, ...]
    peak: tuple[int, ...]
    error: str | None = None

    @property
    def bubble(self) -> float:
        """Idle over total rank time: ``1 - sum(busy) / (p * makespan)``."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def _structure(table: Sequence[Sequence[Step]], placement: str, v: int, m: int) -> str | None:
    """The first missing, repeated, unknown or misordered step, or None. A table without any
    ``B``/``I``/``W`` is forward-only (:func:`.steps.forward_only`): every (microbatch, chunk)
    then runs ``F`` alone."""
    p = len(table)
    fwd = all(isinstance(s, tuple) and len(s) == 3 and s[0] == "F" for row in table for s in row)
    complete = ({"F"},) if fwd else ({"F", "B"}, {"F", "I", "W"})
    for r, row in enumerate(table):
        seen: dict[tuple[str, int, int], int] = {}
        for i, s in enumerate(row):
            if not isinstance(s, tuple) or len(s) != 3 or s[0] not in KINDS or not _ints(s[1:]):
                return f"rank {r}: bad step {s!r}; expected Step(F|B|I|W, microbatch, chunk)"
            if not (0 <= s[1] < m and 0 <= s[2] < v):
                return f"rank {r}: {s} outside microbatches 0..{m - 1} or chunks 0..{v - 1}"
            if s in seen:
                return f"rank {r} runs {s} twice"
            seen[s] = i
        for j in range(m):
            for c in range(v):
                has = {k for k in KINDS if (k, j, c) in seen}
                if has not in complete:
                    g = global_chunk(placement, r, c, p)
                    want = "F (forward-only)" if fwd else "F+B or F+I+W"
                    return f"rank {r}, microbatch {j}, chunk {g}: runs {sorted(has)}, expected {want}"
                before = [("F", "B"), ("F", "I"), ("I", "W")]
                for a, b in before:
                    if b in has and seen[(a, j, c)] > seen[(b, j, c)]:
                        return f"dependency violation: rank {r} runs {Step(b, j, c)} before {Step(a, j, c)}"
    return None


def _ints(xs: Sequence[object]) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in xs)


def _peak(row: Sequence[Step]) -> int:
    live = peak = 0
    for s in row:
        kind = s[0] if isinstance(s, tuple) and s else None
        live += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
        peak = max(peak, live)
    return peak


def _needs(s: Step, rank: int, placement: str, p: int, v: int) -> list[tuple[str, int, int]]:
    """The (kind, microbatch, global chunk) keys step ``s`` of ``rank`` waits for (``"G"`` =
    either ``B`` or ``I``: the gradient of that chunk's input)."""
    g = global_chunk(placement, rank, s.chunk, p)
    if s.kind == "F":
        return [("F", s.microbatch, g - 1)] if g > 0 else []
    if s.kind == "W":
        return [("I", s.microbatch, g)]
    return [("F", s.microbatch, g)] + ([("G", s.microbatch, g + 1)] if g < p * v - 1 else [])


def _end(done: Mapping[tuple[str, int, int], float], key: tuple[str, int, int]) -> float | None:
    """When ``key`` ended (None: not yet); ``"G"`` is whichever of ``B`` / ``I`` ran."""
    if key[0] != "G":
        return done.get(key)
    return done.get(("B", *key[1:]), done.get(("I", *key[1:])))


def simulate_steps(
    table: Sequence[Sequence[Step]],
    *,
    placement: str = "looped",
    v: int = 1,
    num_microbatches: int,
    costs: Mapping[str, float] = UNIT_COSTS,
) -> Report:
    """Run ``table`` (one row per rank) in lock-step under data dependencies.

    Args:
        table: ``p`` rows of :class:`Step`.
        placement: ``"looped"`` or ``"v"`` (:mod:`.steps`).
        v: chunks per rank.
        num_microbatches: ``m``; every (microbatch, chunk) must run F and B, or F, I and W.
        costs: the duration of each kind (default ``F = I = W = 1``, ``B = 2``).

    Returns:
        a :class:`Report`; its ``error`` names a structural problem, a step ordered before one
        it needs on the same rank, or a deadlock (no rank can start its next step).
    """
    p, m = len(table), num_microbatches
    peak = tuple(_peak(row) for row in table)
    why = _structure(table, placement, v, m)
    if why is not None:
        return Report(0.0, (0.0,) * p, peak, why)
    table = [[Step(*s) for s in row] for row in table]  # plain (kind, microbatch, chunk) tuples too
    done: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, global chunk) -> end time
    pc, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    while True:
        progressed = False
        for r in range(p):
            while pc[r] < len(table[r]):
                s = table[r][pc[r]]
                needs = _needs(s, r, placement, p, v)
                ends = [_end(done, k) for k in needs]
                if any(e is None for e in ends):
                    break
                start = max([clock[r], *(e for e in ends if e is not None)])
                clock[r] = start + costs[s.kind]
                busy[r] += costs[s.kind]
                done[(s.kind, s.microbatch, global_chunk(placement, r, s.chunk, p))] = clock[r]
                pc[r] += 1
                progressed = True
        if all(pc[r] == len(table[r]) for r in range(p)):
            return Report(max(clock), tuple(busy), peak)
        if not progressed:
            stuck = {r: table[r][pc[r]] for r in range(p) if pc[r] < len(table[r])}
            return Report(max(clock), tuple(busy), peak, f"deadlock: blocked ranks and their next step: {stuck}")


Message = tuple[str, int, int]  # ("F" activation | "B" gradient, microbatch, receiving global chunk)


def transfers(
    table: Sequence[Sequence[Step]], *, placement: str = "looped", v: int = 1
) -> tuple[dict[tuple[int, int], list[Message]], dict[tuple[int, int], list[Message]]]:
    """The cross-rank messages of a table, per channel ``(src rank, dst rank)``: ``(sent,
    needed)``, each channel's messages in the order the sender produces them (right after the
    step that computes them) and in the order the receiver's row first needs them. Chunks on
    the same rank exchange nothing. Activations and gradients between the same two ranks share
    one channel: without tags (NCCL) they pair in FIFO order.
    """
    p = len(table)
    last = p * v - 1
    sent: dict[tuple[int, int], list[Message]] = {}
    needed: dict[tuple[int, int], list[Message]] = {}
    for r, row in enumerate(table):
        for s in row:
            if s.kind == "W":
                continue
            g = global_chunk(placement, r, s.chunk, p)
            src_g, dst_g, tag = (g - 1, g + 1, "F") if s.kind == "F" else (g + 1, g - 1, "B")
            if 0 <= src_g <= last and (q := chunk_owner(placement, src_g, p)[0]) != r:
                needed.setdefault((q, r), []).append((tag, s.microbatch, g))
            if 0 <= dst_g <= last and (q := chunk_owner(placement, dst_g, p)[0]) != r:
                sent.setdefault((r, q), []).append((tag, s.microbatch, dst_g))
    return sent, needed


def fifo_mismatches(table: Sequence[Sequence[Step]], *, placement: str = "looped", v: int = 1) -> list[tuple[int, int]]:
    """Channels whose receiver needs messages in another order than the sender sends them.

    On those, receiving each message right before the step that needs it would pair the wrong
    messages under FIFO matching: the receiver must post its receives in the sender's order
    (both rows are known to every rank) and hold early arrivals. Empty for the one-chunk and
    looped tables; not always for the V-shaped ones (e.g. ``zbv`` at p = 2, m = 4; tested).
    """
    sent, needed = transfers(table, placement=placement, v=v)
    return sorted(k for k in set(sent) | set(needed) if sent.get(k) != needed.get(k))


@dataclass(frozen=True)
class SimResult:
    """What the deprecated :func:`simulate` returns: :class:`Report`'s fields under their former
    names (``peak_activations``, ``bubble_fraction``)."""

    makespan: float
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]
    error: str | None = None

    bubble_fraction = Report.bubble  # the same fields, the same formula


def simulate(schedule: Sequence[Sequence[Action]], f_time: float = 1.0, b_time: float = 1.0) -> SimResult:
    """Deprecated (one release): :func:`simulate_steps` on a one-chunk ``Action`` table (lifted,
    :func:`.steps.lift`) with ``F`` taking ``f_time`` and ``B`` ``b_time``. The dataflow model
    replaces the former blocking-P2P one: the runner holds a message that arrives before its
    step, so a table whose stages exchange messages in another order is no longer an error; a
    deadlock still is."""
    warnings.warn(
        "shardkit.pipeline_parallel.simulate is deprecated: use pipeline_parallel.simulate.simulate_steps"
        "(pipeline_parallel.steps.lift(table), num_microbatches=M)",
        DeprecationWarning,
        stacklevel=2,
    )
    table = lift(schedule)
    m = 1 + max((st.microbatch for row in table for st in row), default=-1)
    costs = {"F": f_time, "B": b_time, "I": b_time / 2, "W": b_time / 2}
    rep = simulate_steps(table, num_microbatches=m, costs=costs)
    return SimResult(rep.makespan, rep.busy, rep.peak, rep.error)
