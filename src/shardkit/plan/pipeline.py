"""The pipeline schedule's time and activation memory, for every schedule of the registry.

``p`` pipeline ranks, ``v`` chunks (virtual stages) per rank, ``m`` microbatches. The costs of
one microbatch on one chunk: ``f`` its forward; its backward ``b = 2 f``, split for the
zero-bubble schedules into the input gradient ``I = f`` and the weight gradient ``W = f``. The
split is FLOP counting: a linear layer ``Y = X A`` costs ``2 n k`` per token forward, and its
input gradient ``dY A^T`` and weight gradient ``X^T dY`` cost as much each (the equal-cost case
of Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 3; backward = 2 x forward as
in Narayanan et al., SC 2021). ``x``, one P2P transfer of a microbatch's hidden states, is a
resource of its own: :func:`~.p2p_timeline.p2p_timeline` runs the table with each transfer on
its link, a send overlapping the sender's next steps and a receive posted when the runner posts
it (the trainer's steady state on NCCL: ahead, so a transfer shows only where the schedule's
dependencies wait for it), for ``p v m <= P2P_SIMULATE_LIMIT``. Above it,
and in the closed forms below, ``x`` is added to every step that sends (``F``, ``B``, ``I``;
not ``W``), the former charge (an upper bound of the time line's on the registry's tables at
the sizes the tests run).

The makespan of the schedule's real table (:mod:`shardkit.pipeline_parallel.tables`) comes from
the dependency simulator (:func:`~shardkit.pipeline_parallel.simulate.simulate_steps`) while the
table is small (``p v m <= SIMULATE_LIMIT`` microbatch-chunks), otherwise from a closed form
(``F, I, W, B`` the step costs above, P2P included):

* ``1f1b``, ``gpipe``: ``(m + p - 1)(F + B)`` (Narayanan et al. 2021);
* ``interleaved-1f1b``, ``looped-bfs``: ``(v m + p - 1)(F + B)`` (the interleaved bubble is the
  1F1B one over ``v``, Narayanan et al. 2021 sec. 2.2.2; breadth-first: Lamy-Poirier 2023), for
  ``m >= p``; ``looped-bfs`` with ``m < p``: ``(p v + m - 1)(F + B)``;
* ``zb-h1``, ``m >= p``: ``m (F + I + W) + (p - 1)(F + I - W)`` (Qi et al. 2024, sec. 3.1);
  ``interleaved-zb``, ``m >= p``: the same over ``v m`` chunk-microbatches (found with the simulator);
* ``zbv`` (``m >= p + 2``), ``dualpipev``, with ``I = F`` (as here): ``v m (F + I + W) + (p - 1)
  (F + I - W)``, ZB-H1's form over ``v`` chunks: at ``x = 0`` that is ``6 m f + (p - 1) f``, the
  sources' near-zero bubble (found with the simulator; with ``I != F`` the table is simulated).

``tests/plan/test_pipeline.py`` checks that the closed forms equal the simulator wherever both
apply, at unequal costs too. Peak in-flight microbatch-chunks per rank (activations held) come
from the table (:func:`peak_chunks`; closed forms in :mod:`~shardkit.pipeline_parallel.tables`'
docstrings, checked against the table in the tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..pipeline_parallel.simulate import simulate_steps
from ..pipeline_parallel.tables import SCHEDULES
from .p2p_timeline import p2p_timeline

__all__ = [
    "SIMULATE_LIMIT",
    "P2P_SIMULATE_LIMIT",
    "PipelineCost",
    "pipeline_cost",
    "closed_makespan",
    "peak_chunks",
    "step_costs",
]

SIMULATE_LIMIT = 512  # microbatch-chunks per rank x ranks; above it the closed forms (the simulator is O(p v m))
P2P_SIMULATE_LIMIT = 4096  # the P2P time line's limit (also O(p v m); Llama 3 405B's p 16, v <= 7, m 16 is under it)


@dataclass(frozen=True)
class PipelineCost:
    """One schedule's step on one pipeline.

    Attributes:
        makespan: seconds from the first forward to the last backward (P2P included).
        bubble: the schedule's idle fraction of a rank, ``1 - compute / makespan`` with free P2P
            (the sources' bubble; the P2P time is in ``makespan`` only).
        peak: the most in-flight microbatch-chunks on any rank.
        simulated: True when the simulator ran the real table, False for a closed form.
        p2p_s: the P2P seconds on the critical path, ``makespan`` less the makespan with free
            transfers (from the time line where ``p v m <= P2P_SIMULATE_LIMIT``).
    """

    makespan: float
    bubble: float
    peak: int
    simulated: bool
    p2p_s: float = 0.0


def step_costs(f: float, x: float) -> dict[str, float]:
    """The simulator's costs of each step kind: forward ``f`` seconds per microbatch-chunk,
    ``I = W = f``, ``B = 2 f``, and ``x`` seconds of P2P on each step that sends."""
    return {"F": f + x, "I": f + x, "W": f, "B": 2 * f + x}


def closed_makespan(schedule: str, p: int, v: int, m: int, costs: dict[str, float]) -> float:
    """The makespan of ``schedule``'s table from its closed form (the module docstring).

    ``zbv`` and ``dualpipev`` have one where ``I`` costs what ``F`` does (the planner's costs)
    and, for ``zbv``, ``m >= p + 2``; ``zb-h1`` where ``m >= p``; elsewhere the table is simulated.
    """
    fwd, inp, wgt, bwd = costs["F"], costs["I"], costs["W"], costs["B"]
    if schedule in ("1f1b", "gpipe"):
        return (m + p - 1) * (fwd + bwd)
    if schedule in ("interleaved-1f1b", "looped-bfs"):  # looped-bfs with m < p: the chunks' chain sets the pace
        return max(v * m + p - 1, p * v + m - 1) * (fwd + bwd)
    zb = (schedule in ("zb-h1", "interleaved-zb") and m >= p) or (
        inp == fwd and (schedule == "dualpipev" or (schedule == "zbv" and m >= p + 2))
    )
    if zb:
        return m * v * (fwd + inp + wgt) + (p - 1) * (fwd + inp - wgt)
    return _simulated(schedule, p, v, m, tuple(sorted(costs.items())))[0]


@functools.lru_cache(maxsize=8192)  # plan_layouts asks for the same few tables thousands of times
def _simulated(schedule: str, p: int, v: int, m: int, costs: tuple[tuple[str, float], ...]) -> tuple[float, int]:
    spec = SCHEDULES[schedule]
    report = simulate_steps(spec.build(p, v, m), placement=spec.placement, v=v, num_microbatches=m, costs=dict(costs))
    if report.error is not None:  # the registry's tables are checked by its own tests; this is a bug
        raise AssertionError(f"{schedule} p={p} v={v} m={m}: {report.error}")
    return report.makespan, max(report.peak)


def peak_chunks(schedule: str, p: int, v: int, m: int, rank: int | None = None) -> int:
    """In-flight microbatch-chunks (forwards whose backward has not finished) at the peak, on
    ``rank`` (None: the fullest rank), from the schedule's sources' counts:

    ``1f1b``, ``zb-h1``: ``min(p - r, m)`` (zb-h1: ``min(p, m)`` on every rank; its W lags
    ``r`` steps); ``gpipe``: ``m``; ``interleaved-1f1b``: ``min(2(p - r - 1) + (v - 1)p + 1, v m)``;
    ``looped-bfs``: ``v m``; ``interleaved-zb``: ``min((v - 1) k + p, v m)``, ``k = m / max(1, m // p)``;
    ``zbv``: ``min(2p, ...)`` (``2p`` once ``m >= 2p``), ``dualpipev``: ``2p + 1``.
    Below ``SIMULATE_LIMIT`` (and for ``zbv`` with ``m < 2p``) the table itself is counted.
    """
    if p * v * m <= SIMULATE_LIMIT or (schedule == "zbv" and m < 2 * p):
        counts = _table_peaks(schedule, p, v, m)
        return max(counts) if rank is None else counts[rank]
    r = 0 if rank is None else rank
    if schedule == "1f1b":
        return min(p - r, m)
    if schedule == "zb-h1":
        return min(p, m)
    if schedule == "gpipe":
        return m
    if schedule == "interleaved-1f1b":
        return min(2 * (p - r - 1) + (v - 1) * p + 1, v * m)
    if schedule == "looped-bfs":
        return v * m
    if schedule == "interleaved-zb":  # every rank: the last chunk's warm-up of one round, plus p
        return min((v - 1) * (m // max(1, m // p)) + p, v * m)
    return 2 * p if schedule == "zbv" else 2 * p + 1


@functools.lru_cache(maxsize=4096)
def _table_peaks(schedule: str, p: int, v: int, m: int) -> tuple[int, ...]:
    """Per rank, the most forwards whose backward (``B``, or ``I`` and then ``W``) has not run."""
    out = []
    for row in SCHEDULES[schedule].build(p, v, m):
        live = peak = 0
        for s in row:
            live += 1 if s.kind == "F" else -1 if s.kind in ("B", "W") else 0
            peak = max(peak, live)
        out.append(peak)
    return tuple(out)


def pipeline_cost(
    schedule: str, p: int, v: int, m: int, f: float, x: float = 0.0, posting: str = "ahead"
) -> PipelineCost:
    """The time and peak activations of ``schedule`` on ``p`` ranks, ``v`` chunks each, ``m``
    microbatches, ``f`` seconds of forward per microbatch-chunk and ``x`` seconds per P2P transfer.

    ``p`` 1 is plain gradient accumulation: ``3 f m v`` seconds, one microbatch in flight.
    The sizes must be valid (:func:`shardkit.plan.rules.check_schedule`). The table runs in
    units of ``f`` with ``x / f`` rounded to 3 significant digits (so the simulations are shared).
    ``posting``: when receives are posted (:func:`~.p2p_timeline.p2p_timeline`; ``"ahead"``: the
    trainer on NCCL after its first step).
    """
    compute = 3 * f * v * m
    if p == 1:
        return PipelineCost(compute, 0.0, 1, False)
    simulated = p * v * m <= SIMULATE_LIMIT

    def span(ratio: float) -> float:  # in units of f: one simulation serves every layout of these sizes
        if ratio > 0 and p * v * m <= P2P_SIMULATE_LIMIT:
            return _timeline(schedule, p, v, m, ratio, posting)
        costs = step_costs(1.0, ratio)
        if simulated:
            return _simulated(schedule, p, v, m, tuple(sorted(costs.items())))[0]
        return closed_makespan(schedule, p, v, m, costs)

    free = span(0.0)
    bubble = 1.0 - 3 * v * m / free
    makespan = f * span(float(f"{x / f:.3g}") if f > 0 else 0.0)  # the P2P ratio to 3 digits
    return PipelineCost(makespan, bubble, peak_chunks(schedule, p, v, m), simulated, makespan - f * free)


@functools.lru_cache(maxsize=8192)
def _timeline(schedule: str, p: int, v: int, m: int, ratio: float, posting: str) -> float:
    """The P2P time line's makespan in units of ``f`` (transfers ``ratio`` each)."""
    spec = SCHEDULES[schedule]
    costs = step_costs(1.0, 0.0)
    table = spec.build(p, v, m)
    return p2p_timeline(
        table, placement=spec.placement, v=v, num_microbatches=m, costs=costs, x=ratio, posting=posting
    ).makespan
