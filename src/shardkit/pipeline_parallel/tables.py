"""Pipeline schedules as data: pure functions ``(p, v, m) -> table`` and one registry.

``p`` pipeline ranks, ``v`` chunks (virtual stages) per rank, ``m`` microbatches. A table has
one row of :class:`~.steps.Step` per rank (:mod:`.steps`); :func:`.simulate.simulate_steps`
checks one and measures its bubble and peak in-flight activations. :data:`SCHEDULES` maps each
schedule's name to a :class:`ScheduleSpec`. The runner (:func:`.runner.run_schedule`) executes
the one-chunk ``F``/``B`` tables (``1f1b``, ``gpipe``) through :func:`.steps.lower`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..errors import ShardkitError
from .schedules import gpipe_schedule, one_f_one_b_schedule
from .steps import Step, Table, check_sizes, lift
from .tables_v import _Row, dualpipev_table, zbv_table

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "ScheduleSpec",
    "SCHEDULES",
    "schedule_table",
    "gpipe_table",
    "one_f_one_b_table",
    "interleaved_1f1b_table",
    "looped_bfs_table",
    "zb_h1_table",
    "interleaved_zb_table",
    "zbv_table",
    "dualpipev_table",
]


def gpipe_table(p: int, v: int, m: int) -> Table:
    """GPipe (Huang et al., NeurIPS 2019): all forwards, then all backwards.

    Source: bubble ``(p - 1) / (m + p - 1)``; peak in-flight ``m`` microbatches per rank.

    Raises:
        ShardkitError: ``v != 1`` or sizes not ints >= 1.
    """
    check_sizes("gpipe", p, v, m, v_min=1, v_max=1)
    return lift(gpipe_schedule(p, m))


def one_f_one_b_table(p: int, v: int, m: int) -> Table:
    """1F1B / PipeDream-Flush (Narayanan et al., SC 2021, sec. 2.2; Megatron-LM's
    non-interleaved schedule): ``min(p - r - 1, m)`` warm-up forwards on rank ``r``, then
    alternating F/B, then the remaining backwards.

    Source: bubble ``(p - 1) / (m + p - 1)`` (same as GPipe); peak in-flight ``min(p - r, m)``
    microbatches on rank ``r``.

    Raises:
        ShardkitError: ``v != 1`` or sizes not ints >= 1.
    """
    check_sizes("1f1b", p, v, m, v_min=1, v_max=1)
    return lift(one_f_one_b_schedule(p, m))


def _interleaved_order(k: int, p: int, v: int, backward: bool) -> tuple[int, int]:
    """(microbatch, local chunk) of a rank's ``k``-th forward (or backward) in the interleaved
    order: groups of ``p`` microbatches visit the chunks in turn (backwards in reverse)."""
    chunk = (k // p) % v
    return (k // (p * v)) * p + k % p, (v - 1 - chunk if backward else chunk)


def interleaved_1f1b_table(p: int, v: int, m: int) -> Table:
    """Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", SC 2021, sec. 2.2.2), looped placement: rank ``r`` holds
    chunks ``r, r + p, ...``. Rank ``r`` runs ``min(2(p - r - 1) + (v - 1)p, m v)`` warm-up
    forwards (Megatron-LM's count), then alternates F/B, then the remaining backwards; the
    ``k``-th forward is microbatch ``(k // pv) p + k % p`` on local chunk ``(k // p) % v``.

    Source: bubble time ``(1/v)(p - 1)(t_f + t_b)``, i.e. fraction ``(p - 1) / (v m + p - 1)``
    with ``t_f, t_b`` a chunk's times; activation memory ``(1 + (p - 1)/(p v))`` times 1F1B's
    ``p`` microbatches on rank 0. Here: peak in-flight chunk-microbatches on rank ``r``
    ``min(2(p - r - 1) + (v - 1)p + 1, v m)`` (divide by ``v`` for whole-stage units; on rank 0
    that is ``p (1 + (p - 1)/(p v))``, the source's figure).

    Raises:
        ShardkitError: ``v < 2`` (``v = 1`` is ``1f1b``), ``m < p`` or ``m % p != 0``
            (Megatron-LM's requirement: microbatches go round the chunks in groups of ``p``).
    """
    check_sizes("interleaved-1f1b", p, v, m, v_min=2, m_min=p)
    if m % p:
        raise ShardkitError(f"interleaved-1f1b: m (microbatches) must be a multiple of p={p}, got {m}")
    total = m * v
    table = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
        fwd = [Step("F", *_interleaved_order(k, p, v, False)) for k in range(total)]
        bwd = [Step("B", *_interleaved_order(k, p, v, True)) for k in range(total)]
        row = fwd[:warm]
        for k in range(total - warm):
            row += [fwd[warm + k], bwd[k]]
        table.append(tuple(row + bwd[total - warm :]))
    return tuple(table)


def looped_bfs_table(p: int, v: int, m: int) -> Table:
    """Looped BFS (Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023; PyTorch's
    ``ScheduleLoopedBFS``), looped placement: each rank runs every microbatch's forward on its
    chunk 0, then on chunk 1, ...; then the backwards, last chunk first.

    Source: bubble of GPipe over ``p v`` stages with ``p`` devices, ``(p - 1) / (v m + p - 1)``
    when ``m >= p``; peak in-flight ``v m`` chunk-microbatches per rank (``m`` whole stages).

    Raises:
        ShardkitError: sizes not ints >= 1.
    """
    check_sizes("looped-bfs", p, v, m)
    row = [Step("F", j, c) for c in range(v) for j in range(m)]
    row += [Step("B", j, c) for c in reversed(range(v)) for j in range(m)]
    return tuple(tuple(row) for _ in range(p))


def zb_h1_table(p: int, v: int, m: int) -> Table:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 3.1): 1F1B with
    each backward split into ``I`` (input gradient, on the critical path) and ``W`` (weight
    gradient, deferred). Rank ``r`` runs 1F1B's ``p - r - 1`` warm-up forwards, then (F, I)
    pairs whose ``W`` lags its ``I`` by ``r`` steps, so that the ``W`` s fill the tail bubble.

    Source: peak memory no more than 1F1B's (``p`` in-flight microbatches, on every rank);
    bubble ``(p - 1)(t_f + t_i - t_w)``: with ``t_f = t_i = t_w`` a third of 1F1B's. Here, at unit
    costs: makespan ``3m + p - 1``, i.e. bubble ``(p - 1) / (3m + p - 1)`` (tested).

    Raises:
        ShardkitError: ``v != 1`` or sizes not ints >= 1.
    """
    check_sizes("zb-h1", p, v, m, v_min=1, v_max=1)
    table = []
    for r in range(p):
        warm = min(p - r - 1, m)
        row = [Step("F", j) for j in range(warm)]
        pending: list[Step] = []
        for j in range(m):
            if warm + j < m:
                row.append(Step("F", warm + j))
            row.append(Step("I", j))
            pending.append(Step("W", j))
            if len(pending) > r:
                row.append(pending.pop(0))
        table.append(tuple(row + pending))
    return tuple(table)


def interleaved_zb_table(p: int, v: int, m: int) -> Table:
    """Interleaved zero bubble (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024: ZB-H1
    over looped chunks; the order of torch.distributed.pipelining's
    ``ScheduleInterleavedZeroBubble``, its "ZB1P"). Microbatches go round the chunks in rounds
    of ``k = m / max(1, m // p)``: the ``i``-th forward of a rank runs local chunk ``(i // k) % v``,
    its ``i``-th input gradient chunk ``v - 1 - (i // k) % v``, each chunk's microbatches in
    order. Rank ``r`` runs ``min((v - 1) k + p - 1 - r, v m)`` warm-up forwards, then pairs
    (F, I) while forwards remain, then the remaining ``I`` s; from its ``(r + 1)``-th ``I`` on,
    each ``I`` is followed by the oldest pending ``W`` (the ``W`` s lag ``r`` steps, as in
    ZB-H1), and the rest of the ``W`` s close the row.

    Source's claims: ZB-H1's memory (here per chunk) and a bubble below interleaved 1F1B's.
    Here, at unit costs: peak in-flight chunk-microbatches ``min((v - 1) k + p, v m)`` on every
    rank; makespan ``3 v m + p - 1`` when ``m >= p``, a bubble ``(p - 1) / (3 v m + p - 1)``:
    ZB-H1's over ``v`` chunks (both tested).

    Raises:
        ShardkitError: ``v < 2`` (``v = 1`` is ``zb-h1``) or ``m`` not a multiple of its rounds
            ``max(1, m // p)`` (torch's rule: each round holds the same microbatches).
    """
    check_sizes("interleaved-zb", p, v, m, v_min=2)
    rounds = max(1, m // p)
    if m % rounds:
        raise ShardkitError(f"interleaved-zb: m (microbatches) must be a multiple of max(1, m // p)={rounds}, got {m}")
    k, total = m // rounds, v * m
    table = []
    for r in range(p):
        warm = min((v - 1) * k + p - 1 - r, total)
        row = _Row(m)
        for i in range(warm):
            row.add("F", (i // k) % v)
        for i in range(total):
            if warm + i < total:
                row.add("F", ((warm + i) // k) % v)
            row.add("I", v - 1 - (i // k) % v)
            if i >= r:
                row.weight()
        while row.w_queue:
            row.weight()
        table.append(tuple(row.steps))
    return tuple(table)


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule: its table function ``build(p, v, m)``, the placement of chunks (``"looped"``
    or ``"v"``), the chunks per rank it accepts (``v_min..v_max``, ``v_max`` None: unbounded)
    and whether it splits backwards into ``I``/``W``. The table function's docstring gives the
    source, the bubble and the peak in-flight activations."""

    build: Callable[[int, int, int], Table]
    placement: str
    v_min: int
    v_max: int | None
    split_backward: bool


SCHEDULES = MappingProxyType(
    {
        "1f1b": ScheduleSpec(one_f_one_b_table, "looped", 1, 1, False),
        "gpipe": ScheduleSpec(gpipe_table, "looped", 1, 1, False),
        "interleaved-1f1b": ScheduleSpec(interleaved_1f1b_table, "looped", 2, None, False),
        "looped-bfs": ScheduleSpec(looped_bfs_table, "looped", 1, None, False),
        "zb-h1": ScheduleSpec(zb_h1_table, "looped", 1, 1, True),
        "zbv": ScheduleSpec(zbv_table, "v", 2, 2, True),
        "interleaved-zb": ScheduleSpec(interleaved_zb_table, "looped", 2, None, True),
        "dualpipev": ScheduleSpec(dualpipev_table, "v", 2, 2, True),
    }
)


def schedule_table(name: str, p: int, v: int, m: int) -> Table:
    """The table of schedule ``name`` (a key of :data:`SCHEDULES`).

    Raises:
        ShardkitError: unknown name, or sizes the schedule refuses (see its table function).
    """
    if name not in SCHEDULES:
        raise ShardkitError(f"unknown pipeline schedule {name!r}; expected one of {sorted(SCHEDULES)}")
    return SCHEDULES[name].build(p, v, m)
