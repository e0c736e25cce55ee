"""The action vocabulary of multi-chunk (virtual-stage) and zero-bubble schedule tables.

A table is a tuple with one row per pipeline rank (``p`` rows); a row is the ordered tuple of
:class:`Step` s that rank computes. The model is cut into ``p * v`` chunks (virtual stages),
numbered in the order data flows through them; rank ``r`` holds ``v`` of them, named by their
*local* index ``0..v-1`` in a :class:`Step`. A *placement* maps (rank, local chunk) to the
global chunk:

* ``"looped"`` (Narayanan et al., SC 2021; Megatron-LM virtual pipeline): local chunk ``c`` of
  rank ``r`` is chunk ``r + c * p``.
* ``"v"`` (Qi et al. 2024 ZB-V; DeepSeek-V3 DualPipeV), ``v = 2``: local chunk 0 of rank ``r``
  is chunk ``r``, local chunk 1 is chunk ``2p - 1 - r``, so the first and the last chunk (the
  embedding and the loss) sit on rank 0.

Step kinds: ``F`` forward; ``B`` full backward (input and weight gradients together); ``I``
the input gradient only; ``W`` the weight gradient of an earlier ``I``. Each (microbatch,
chunk) runs ``F`` once and either ``B`` once or ``I`` then ``W`` once each.

The one-chunk ``F``/``B`` tables of :mod:`.schedules` (``Action(kind, microbatch)``) lift to
steps with :func:`lift`; the one runner runs every step table on a
:class:`~.stage.PipelineStage` of one chunk or several.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ..errors import ShardkitError
from .schedules import Action

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "Step",
    "Table",
    "KINDS",
    "PLACEMENTS",
    "global_chunk",
    "chunk_owner",
    "lift",
    "forward_only",
    "check_sizes",
]

KINDS = ("F", "B", "I", "W")
PLACEMENTS = ("looped", "v")


class Step(NamedTuple):
    """One compute step of a rank: ``kind`` in ``F|B|I|W``, the ``microbatch`` index and the
    rank-``local`` chunk index (``0..v-1``; see the module docstring for the placement)."""

    kind: str
    microbatch: int
    chunk: int = 0


Table = tuple[tuple[Step, ...], ...]


def global_chunk(placement: str, rank: int, local: int, p: int) -> int:
    """The global chunk (virtual stage, ``0..p*v-1``) of ``rank``'s local chunk ``local``.

    Raises:
        ShardkitError: unknown placement, or a ``"v"`` local chunk other than 0 and 1.
    """
    if placement == "looped":
        return rank + local * p
    if placement == "v":
        if local not in (0, 1):
            raise ShardkitError(f"placement 'v' holds 2 chunks per rank (local 0 or 1), got local chunk {local}")
        return rank if local == 0 else 2 * p - 1 - rank
    raise ShardkitError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")


def chunk_owner(placement: str, chunk: int, p: int) -> tuple[int, int]:
    """``(rank, local chunk)`` holding global ``chunk`` (the inverse of :func:`global_chunk`)."""
    if placement == "looped":
        return chunk % p, chunk // p
    if placement == "v":
        return (chunk, 0) if chunk < p else (2 * p - 1 - chunk, 1)
    raise ShardkitError(f"unknown placement {placement!r}; expected one of {PLACEMENTS}")


def lift(table: Sequence[Sequence[Action]]) -> Table:
    """A one-chunk ``Action`` table as a :class:`Step` table (chunk 0 everywhere)."""
    return tuple(tuple(Step(a[0], a[1], 0) for a in row) for row in table)


def forward_only(table: Sequence[Sequence[tuple]]) -> tuple[tuple, ...]:
    """The forward-only table of ``table`` (an ``Action`` or :class:`Step` table): each row's
    ``F`` steps in their order, every ``B``/``I``/``W`` dropped (pure).

    Why it cannot deadlock when ``table`` cannot: a forward waits only for the forward of the
    previous chunk on the same microbatch and for the steps before it in its row; the forwards
    kept are in the same row order, so every wait of the forward-only table is one the full
    table had (or implied through a dropped step), and no cycle appears. The messages of a
    channel keep the sender's order (the activations' order is the ``F`` order). Checked again
    by the simulator, as every table is (:func:`.simulate.simulate_steps`).
    """
    return tuple(tuple(a for a in row if a[0] == "F") for row in table)


def check_sizes(op: str, p: int, v: int, m: int, *, v_min: int = 1, v_max: int | None = None, m_min: int = 1) -> None:
    """Check a schedule's sizes: ``p`` ranks, ``v`` chunks per rank, ``m`` microbatches.

    Raises:
        ShardkitError: ``p``, ``v`` or ``m`` not an int; ``p < 1``; ``v`` outside
            ``v_min..v_max`` (``v_max`` None: no upper bound); ``m < m_min``.
    """
    for name, x in (("p", p), ("v", v), ("m", m)):
        if not isinstance(x, int) or isinstance(x, bool):
            raise ShardkitError(f"{op}: {name} must be an int, got {x!r}")
    if p < 1:
        raise ShardkitError(f"{op}: p (pipeline ranks) must be >= 1, got {p}")
    if v < v_min or (v_max is not None and v > v_max):
        want = f">= {v_min}" if v_max is None else str(v_min) if v_min == v_max else f"in {v_min}..{v_max}"
        raise ShardkitError(f"{op}: v (chunks per rank) must be {want}, got {v}")
    if m < m_min:
        raise ShardkitError(f"{op}: m (microbatches) must be >= {m_min} here, got {m}")
