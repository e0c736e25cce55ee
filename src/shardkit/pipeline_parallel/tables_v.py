"""V-shape schedule tables (``v = 2``, placement ``"v"``: rank ``r`` holds chunks ``r`` and
``2p - 1 - r``): ZB-V and DualPipeV. Pure functions of ``(p, v, m)``; see :mod:`.steps`.

Local chunk 0 is the descending leg (chunks ``0..p-1``), local chunk 1 the ascending leg
(chunks ``p..2p-1``). Each (kind, chunk) runs its microbatches in order ``0..m-1``.
"""

from __future__ import annotations

from .steps import Step, Table, check_sizes

__all__ = ["zbv_table", "dualpipev_table"]


class _Row:
    """One rank's row under construction: per (kind, chunk) counters and the W queue."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.steps: list[Step] = []
        self.next: dict[tuple[str, int], int] = {}
        self.w_queue: list[Step] = []

    def add(self, kind: str, chunk: int) -> None:
        """Append ``kind`` on ``chunk`` for its next microbatch (no-op once all ``m`` ran)."""
        key = ("F" if kind == "F" else "G", chunk)  # B and I share one backward order
        j = self.next.get(key, 0)
        if j >= self.m:
            return
        self.next[key] = j + 1
        self.steps.append(Step(kind, j, chunk))
        if kind == "I":
            self.w_queue.append(Step("W", j, chunk))

    def weight(self) -> None:
        """Append the oldest pending ``W`` (no-op when none is pending)."""
        if self.w_queue:
            self.steps.append(self.w_queue.pop(0))


def zbv_table(p: int, v: int, m: int) -> Table:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024; the V-shape
    zero-bubble schedule of "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 6).

    Rank ``r``: ``2(p - r) - 1`` forwards of chunk 0; ``r`` pairs (F chunk 1, F chunk 0);
    ``p - r`` triples (F, I, W) of chunk 1; then (F, I, W) of chunk 0 and of chunk 1 in turn
    until the forwards run out; in the cool-down each ``W`` lags its ``I`` by ``r`` steps (rank
    ``r`` finishes its input gradients ``r`` steps before rank 0 must, as in ZB-H1).

    Source's claims: peak activation memory equal to 1F1B's (``p`` whole-stage microbatches =
    ``2p`` half-stage chunks on every rank); with ``F = I = W`` almost no bubble.
    Here, at unit costs ``F = I = W = 1`` a chunk: at most ``2p`` in-flight chunk-microbatches
    on every rank (exactly ``2p`` when ``m >= 2p``); makespan ``6m + p - 1`` when ``m >= p + 2``: the
    least possible, as rank ``p - 1`` waits ``p - 1`` forwards for its first input; half ZB-H1's
    bubble time at equal whole-stage costs (all tested).

    Raises:
        ShardkitError: ``v != 2`` or sizes not ints >= 1.
    """
    check_sizes("zbv", p, v, m, v_min=2, v_max=2)
    table = []
    for r in range(p):
        row = _Row(m)
        for _ in range(2 * (p - r) - 1):
            row.add("F", 0)
        for _ in range(r):
            row.add("F", 1)
            row.add("F", 0)
        for _ in range(p - r):
            row.add("F", 1)
            row.add("I", 1)
            row.weight()
        while len(row.steps) + len(row.w_queue) < 6 * m:
            for c in (0, 1):
                steady = row.next.get(("F", c), 0) < m
                row.add("F", c)
                row.add("I", c)
                if steady or len(row.w_queue) > r:  # cool-down: W lags I by r steps, filling the tail
                    row.weight()
        while row.w_queue:
            row.weight()
        table.append(tuple(row.steps))
    return tuple(table)


def dualpipev_table(p: int, v: int, m: int) -> Table:
    """DualPipeV: DeepSeek-V3's DualPipe (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024,
    sec. 3.2.1) cut in half, as the open-source ``dualpipe`` package's DualPipeV runs it.

    Rank ``r`` runs eight phases: ``2(p - r - 1)`` F of chunk 0; ``r + 1`` (F0, F1);
    ``p - r - 1`` (I1, W1, F1); ``m - 2p + r + 1`` (F0, B1, F1, B0) (the source overlaps each
    F/B pair of different chunks; the table lists F first; in this dataflow model they do not
    overlap); ``p - r - 1`` (B1, F1, B0);
    ``r + 1`` (B1, B0) whose backwards switch to I (W deferred) half way, on odd ranks before
    B1, on even ranks before B0; ``p - r - 1`` (W, I0); ``r + 1`` W.

    Source's claims (DeepSeek-V3 report, table 2, for DualPipe): bubble
    ``(PP/2 - 1)(F&B + B - 3W)``, activations ``PP + 1`` microbatches; the halved DualPipeV keeps
    one copy of the parameters where DualPipe keeps two. Here: peak in-flight
    chunk-microbatches ``2p + 1`` on every rank (``2p`` forwards before the first backward, one
    more in the main phase); makespan at unit chunk costs ``6m + p - 1`` (both tested).

    Raises:
        ShardkitError: ``v != 2`` or ``m < 2p`` (the source's requirement).
    """
    check_sizes("dualpipev", p, v, m, v_min=2, v_max=2, m_min=2 * p)
    return tuple(tuple(_dualpipev_row(p, r, m)) for r in range(p))


def _dualpipev_row(p: int, r: int, m: int) -> list[Step]:
    row = _Row(m)
    for _ in range(2 * (p - r - 1)):
        row.add("F", 0)
    for _ in range(r + 1):
        row.add("F", 0)
        row.add("F", 1)
    for _ in range(p - r - 1):
        row.add("I", 1)
        row.weight()
        row.add("F", 1)
    for _ in range(m - 2 * p + r + 1):
        row.add("F", 0)
        row.add("B", 1)
        row.add("F", 1)
        row.add("B", 0)
    for _ in range(p - r - 1):
        row.add("B", 1)
        row.add("F", 1)
        row.add("B", 0)
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        row.add("I" if split else "B", 1)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        row.add("I" if split else "B", 0)
    for _ in range(p - r - 1):
        row.weight()
        row.add("I", 0)
    while row.w_queue:
        row.weight()
    return row.steps
