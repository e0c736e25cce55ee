"""Which collectives of a step overlap compute, as the runtime issues them.

The planner's step time is the pipeline's makespan (P2P in it: :mod:`.p2p_timeline`) plus the
collectives a rank waits for. What the runtime does, per axis of :func:`.collectives.step_collectives`:

* ``tp`` with async TP: the collective-matmul rings' steps overlap one block's matmul each;
  what they leave exposed is :mod:`._tp_rings`'s (``(t - 1) max(0, c - m)`` per ring).
* ``tp``, ``cp``, ``ep``, the pipeline's check and ``world`` (loss, gradient norm): issued
  synchronously inside the step's computation (Megatron's f/g, SP's gather and scatter, the CP
  exchanges, the dispatch all-to-alls): each waits for its input and the next op waits for it,
  so every second is on the critical path.
* ``dp`` (:class:`~shardkit.data_parallel.GradientSync`, :class:`~shardkit.data_parallel.ZeroSync`):
  one bucketed reduction after the last backward of the step and ZeRO's parameter all-gather
  after the optimizer (``trainer.py``: ``pm.grads.reduce()`` after the schedule): nothing runs
  beside them, every second is exposed.
* ``fsdp`` (FSDP2, ``fully_shard`` per decoder layer and the root): each group is gathered once
  per step by its first forward and reduce-scattered once by its last backward
  (:mod:`shardkit.pipeline_parallel._fsdp_steps`; ``set_microbatch`` without a pipeline). FSDP2
  issues the all-gathers on their own stream ahead of the compute (implicit forward prefetch),
  so the gather of layer ``i + 1`` runs during layer ``i``'s forward, and the reduce-scatter of
  layer ``i`` during layer ``i - 1``'s backward. With ``n`` calls of ``a`` seconds each and a
  layer's forward ``f_l`` (backward ``2 f_l``), the exposed gather time is
  ``a + (n - 1) max(0, a - f_l)`` (the first gather waits; each later one shows only where it
  is longer than the layer it hides behind) and the reduce-scatter's
  ``r + (n - 1) max(0, r - 2 f_l)`` (the last one has nothing after it).

The P2P rows (``pp`` send/recv) are the schedule's: :func:`exposed_seconds` leaves them out.
Source: the runtime's code named above; PyTorch FSDP2 docs (``fully_shard``: implicit
prefetching of the next all-gather in forward and the previous one in backward, reduce-scatter
on its own stream).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ShardkitError
from .collectives import CommRow

__all__ = ["CRITICAL_AXES", "exposed_seconds", "fsdp_exposed"]

CRITICAL_AXES = ("tp", "cp", "ep", "pp", "world", "dp")  # synchronous, or with nothing beside them


def _p2p(row: CommRow) -> bool:
    return row.axis == "pp" and row.op in ("send", "recv")


def fsdp_exposed(calls: int, seconds: float, hide: float) -> float:
    """Exposed seconds of ``calls`` FSDP2 collectives of ``seconds`` in all, each after the
    first (gathers; the last for reduce-scatters) hidden behind ``hide`` seconds of one layer's
    compute (pure; the module docstring)."""
    if calls <= 0 or seconds <= 0:
        return 0.0
    each = seconds / calls
    return each + (calls - 1) * max(0.0, each - hide)


def exposed_seconds(timed: Sequence[tuple[CommRow, float]], layer_forward_s: float, tp_rings_s: float = 0.0) -> float:
    """The seconds of ``timed`` (a stage's rows and their alpha-beta seconds) a rank waits for,
    besides the pipeline's P2P, with ``layer_forward_s`` the forward of one decoder layer on one
    microbatch (pure). The async-TP rings' rows (tp ``send``/``recv``) count as ``tp_rings_s``,
    what their schedule leaves uncovered (:func:`._tp_rings.rings_exposed_seconds`).

    Raises:
        ShardkitError: a row on an axis this model does not know (a new axis must be placed here).
    """
    total = tp_rings_s
    for row, s in timed:
        if _p2p(row) or (row.axis == "tp" and row.op in ("send", "recv")):
            continue
        if row.axis in CRITICAL_AXES:
            total += s
        elif row.axis == "fsdp":
            backward = row.phase == "backward"
            total += fsdp_exposed(row.count, s, layer_forward_s * (2 if backward else 1))
        else:
            raise ShardkitError(f"exposed_seconds: no overlap rule for axis {row.axis!r} ({row.api})")
    return total
