"""Load balance of the ring cp layouts (``--cp-layout``): the slowest rank's attention work over the mean.

Under causal attention the token at global position ``p`` attends to ``p + 1`` keys, so a ring
rank's work over a whole pass is ``sum (p + 1)`` over the positions it holds, exactly the visible
(query, key) pairs the block plan gives it (:func:`shardkit.context_parallel._ring_plan.rank_work`,
which the tests compare against). Every ring step waits for the slowest rank, so
``max / mean`` of those sums is the layout's attention slowdown against a perfect split:

* ``zigzag`` (chunks ``r`` and ``2R - 1 - r`` of ``2R``): 1 when ``2R`` divides ``S``;
* ``stripe`` (every ``R``-th token): about ``1 + (R - 1) / S``;
* ``contiguous`` (one block each, Llama 3's per-document layout on one document): ``(2R - 1) / R``
  for long sequences (1.5, 1.75, 1.875 at ``R`` = 2, 4, 8).

The planner's step times assume the trainer's default, zigzag; ``shardkit plan`` prints these
figures for the ring degrees of the layouts it lists. Pure arithmetic on the layouts' ranges.

Source: Brandon et al. "Striped Attention" (2023, stripe); the zigzag layout of ring-flash-attn
and Megatron-LM's context parallelism; Llama 3 (contiguous per-document cp).
"""

from __future__ import annotations

from ..context_parallel._sizes import _layout_ranges

__all__ = ["CP_LAYOUTS", "layout_rank_work", "layout_balance", "balance_lines"]

CP_LAYOUTS = ("zigzag", "stripe", "contiguous")


def _pairs(begin: int, end: int) -> int:
    """``sum (p + 1)`` for ``p`` in ``[begin, end)``."""
    return (end * (end + 1) - begin * (begin + 1)) // 2


def layout_rank_work(seq_len: int, ranks: int, layout: str) -> list[int]:
    """Causal (query, key) pairs each of ``ranks`` ring ranks computes for one sequence of ``seq_len``."""
    if layout == "stripe":
        out = []
        for r in range(ranks):
            n = (seq_len - r + ranks - 1) // ranks if r < seq_len else 0
            out.append(n * (r + 1) + ranks * n * (n - 1) // 2)
        return out
    return [sum(_pairs(a, b) for a, b in _layout_ranges((0, seq_len), ranks, r, layout)) for r in range(ranks)]


def layout_balance(seq_len: int, ranks: int, layout: str) -> float:
    """Slowest rank / mean of :func:`layout_rank_work` (1.0: perfectly balanced)."""
    work = layout_rank_work(seq_len, ranks, layout)
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


def balance_lines(seq_len: int, ring_degrees: list[int]) -> list[str]:
    """``shardkit plan``'s report: one line per ring degree > 1 (sorted), every layout's balance."""
    degrees = sorted({r for r in ring_degrees if r > 1})
    if not degrees:
        return []
    lines = [f"ring cp layouts at seq {seq_len}, causal (slowest rank / mean; the times above assume zigzag):"]
    for r in degrees:
        parts = ", ".join(f"{name} {layout_balance(seq_len, r, name):.3f}" for name in CP_LAYOUTS)
        lines.append(f"  cp_ring={r}: {parts}")
    return lines
