"""Stages made of several ranks: per-stage tensor-parallel sizes (VTP) and boundary layouts.

A pipeline replica is a process group ``group`` of ``T`` ranks cut into ``P`` stages: stage
``s`` is the group ranks ``stage_ranks[s]`` (``t_s`` of them, its tp group; the first is the
stage *leader*, tp rank 0). Sizes may differ per stage, e.g. 4 ranks as ``[[0, 1], [2], [3]]``:
stage 0 with tp=2, stages 1 and 2 with tp=1 (MindSpeed-MM "VTP", layerwise disaggregated
training). Every rank of a stage runs the same schedule actions.

A stage boundary tensor (activation forward, its gradient backward) has a *layout* over the
stage's tp group:

* :class:`~shardkit.sharding.Replicate`: every rank holds the full ``[B, S, H]`` (Megatron TP between blocks).
  Gradient convention: every rank holds the full gradient (Megatron's ``f`` at the entry of a
  TP region all-reduces the input gradient, ``g``'s backward is the identity), so a replicated
  boundary moves one copy of the gradient back, as the forward moves one copy of the value.
* :class:`~shardkit.sharding.Shard` ``(dim)`` (``dim >= 0``): rank ``i`` holds block ``i`` of a balanced split
  along ``dim`` (:func:`~shardkit._shapes.balanced_split_sizes`; sequence-parallel ``[B, S / t, H]``); the
  gradient is sharded the same way and each block's gradient is exact (owned by its rank).

With these conventions the gradient has the layout of the value, so the backward of a boundary
is the same reshard run the other way (:func:`piece_plan` with the roles swapped); the parity
tests check it against one process.

Reshard (minimal traffic across the boundary, which is the slow, inter-node link): every
element crosses it exactly once, then the receiving stage completes the layout inside its tp
group. Rank ``j`` of the receiving stage needs a box of the full tensor (its block, or all of
it); it gets the intersections with the sending ranks' boxes directly from them. A replicated
sender serves receiver ``j`` from its rank ``j % t_src`` (the load spreads over the sender's
links); a replicated receiver gets the full tensor on its leader, which broadcasts it in the
stage (the MindSpeed-MM VTP protocol), except when both sides are replicated with the same tp
size, where rank ``i`` sends to rank ``i`` and nothing is broadcast (Megatron-LM's pp x tp).
A sharded-to-sharded boundary over the same dim and size is then one message per rank pair.

Source: MindSpeed-MM layerwise-disaggregated P2P (VTP leader send + intra-stage broadcast);
Megatron-LM pipeline x tensor parallelism; the box-intersection reshard of array redistribution
(e.g. DTensor redistribute), here point to point.
"""

from __future__ import annotations

from typing import NamedTuple

from .._moved import moved_names
from .._shapes import balanced_split_sizes, split_offsets
from ..sharding import Replicate, Shard
from ..sharding import check_layout as _check_layout

__all__ = ["Replicate", "Shard", "Piece", "local_box", "piece_plan"]

# StageGroups and new_stage_groups moved to shardkit.sharding (deprecated here for one release)
__getattr__ = moved_names(__name__, {"StageGroups": "shardkit.sharding", "new_stage_groups": "shardkit.sharding"})


def check_layout(layout, what: str):
    """A stage boundary layout: ``Replicate()`` or ``Shard(dim)`` with ``dim >= 0``."""
    return _check_layout(layout, what, non_negative=True)


Box = tuple  # ((start, stop), ...) per dim of the full tensor


def local_box(layout, shape, size: int, rank: int) -> Box:
    """The part of a full tensor of ``shape`` that tp rank ``rank`` of ``size`` holds (pure)."""
    box = [(0, n) for n in shape]
    if isinstance(layout, Shard) and size > 1:
        sizes = balanced_split_sizes(shape[layout.dim], size)
        off = split_offsets(sizes)[rank]
        box[layout.dim] = (off, off + sizes[rank])
    return tuple(box)


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


class Piece(NamedTuple):
    """Sending tp rank ``src`` gives receiving tp rank ``dst`` the ``box`` of the full tensor."""

    src: int
    dst: int
    box: Box


def leader_mode(src_layout, t_src: int, dst_layout, t_dst: int) -> bool:
    """Whether the receiving stage's leader gets the full tensor and broadcasts it."""
    same_replicated = isinstance(src_layout, Replicate) and t_src == t_dst
    return isinstance(dst_layout, Replicate) and t_dst > 1 and not same_replicated


def piece_plan(src_layout, t_src: int, dst_layout, t_dst: int, shape) -> list[Piece]:
    """Every message across a boundary (pure: every rank computes the same list).

    Ordered by ``(src, dst)``: a sender posts its pieces in increasing ``dst``, a receiver in
    increasing ``src``, which is deadlock-free even with rendezvous sends (pair ``(i, j)``
    only waits for pairs with a smaller ``i`` or ``j``). Empty intersections send nothing.
    """
    shape = tuple(shape)
    full = tuple((0, n) for n in shape)
    if leader_mode(src_layout, t_src, dst_layout, t_dst):
        wants = {0: full}
    elif isinstance(dst_layout, Replicate):
        wants = {j: full for j in range(t_dst)}
    else:
        wants = {j: local_box(dst_layout, shape, t_dst, j) for j in range(t_dst)}
    pieces = []
    for j, want in wants.items():
        if isinstance(src_layout, Replicate):
            box = _intersect(want, full)
            if box is not None:
                pieces.append(Piece(j % t_src, j, box))
            continue
        for i in range(t_src):
            box = _intersect(want, local_box(src_layout, shape, t_src, i))
            if box is not None:
                pieces.append(Piece(i, j, box))
    return sorted(pieces)
