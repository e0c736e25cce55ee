"""Stages made of several ranks: the groups of one pipeline replica, per-stage tp sizes included.

A pipeline replica is a process group ``group`` of ``T`` ranks cut into ``P`` stages: stage
``s`` is the group ranks ``stage_ranks[s]`` (``t_s`` of them, its tp group; the first is the
stage *leader*, tp rank 0). Sizes may differ per stage, e.g. 4 ranks as ``[[0, 1], [2], [3]]``:
stage 0 with tp=2, stages 1 and 2 with tp=1 (MindSpeed-MM "VTP", layerwise disaggregated
training). :class:`StageGroups` says where they live; :func:`new_stage_groups` creates them
(:meth:`ParallelDims.build_mesh <shardkit.sharding.ParallelDims.build_mesh>` does for a
``pp_tp`` layout). The transfers between such stages are :mod:`shardkit.pipeline_parallel.vtp`'s.

Source: MindSpeed-MM layerwise-disaggregated pipeline stages (VTP); Megatron-LM pipeline x
tensor parallelism.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from .._shapes import split_offsets
from ..comm._compat import world_timeout
from ..comm._group import resolve_group
from ..comm.agree import agree
from ..errors import ShardkitError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._types import Group

__all__ = ["StageGroups", "new_stage_groups"]


class StageGroups:
    """Where the stages of one pipeline replica live.

    Args:
        group: the replica's process group (``ProcessGroup`` or 1-D ``DeviceMesh``) of ``T``
            ranks; P2P between stages uses its group ranks.
        stage_ranks: ``P`` lists of group ranks of ``group``, one per stage, leader first;
            together a partition of ``0..T-1`` (e.g. ``[[0, 1], [2], [3]]``).
        tp_group: this rank's stage group; its group rank ``i`` must be ``stage_ranks[s][i]``.

    Raises:
        ShardkitTypeError: bad group types.
        ShardkitError: on every rank of ``group`` (agreed by :func:`~shardkit.comm.agree.agree`) when
            ranks passed different ``stage_ranks``, they are not a partition of the group, or a
            rank's ``tp_group`` does not have its stage's size and rank order.
    """

    def __init__(self, group: Group, stage_ranks: Sequence[Sequence[int]], tp_group: Group) -> None:
        op = "StageGroups"
        g = resolve_group(group, op)
        tp = resolve_group(tp_group, op)
        ranks, error = _normalize(stage_ranks, g.size)
        s = i = None
        if error is None:
            s, i = next((s, r.index(g.rank)) for s, r in enumerate(ranks) if g.rank in r)
            if tp.size != len(ranks[s]) or tp.rank != i:
                error = (
                    f"its tp_group has size {tp.size} and rank {tp.rank}, but stage {s} is group ranks "
                    f"{list(ranks[s])} (size {len(ranks[s])}, this rank at position {i})"
                )
        shown = ranks if isinstance(ranks, str) else repr(ranks)  # compared and said as its repr

        def judge(seen: list[str]) -> list[str]:
            differ = [r for r, rk in enumerate(seen) if rk != seen[0]]
            return (
                [f"ranks {differ} passed stage_ranks {seen[differ[0]]} but rank 0 passed {seen[0]}"] if differ else []
            )

        agree(g, op, error, shown, judge=judge, headline="mismatched stage layout over {size} ranks")
        self.group, self.tp_group, self.info, self.tp = group, tp_group, g, tp
        self.stage_ranks = ranks
        assert s is not None and i is not None  # found whenever no rank reported an error
        self.stage_index: int = s
        self.tp_rank: int = i
        self.num_stages = len(ranks)
        self.tp_sizes = tuple(len(r) for r in ranks)

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    def __repr__(self) -> str:
        return f"StageGroups(stage_ranks={[list(r) for r in self.stage_ranks]}, stage={self.stage_index})"


def _normalize(stage_ranks, size: int):
    """``(tuple of tuples, None)`` or ``(something comparable, error text)``; pure."""
    try:
        ranks = tuple(tuple(int(r) for r in stage) for stage in stage_ranks)
    except (TypeError, ValueError):
        return repr(stage_ranks), f"stage_ranks must be lists of ints, got {stage_ranks!r}"
    flat = sorted(r for stage in ranks for r in stage)
    if not ranks or any(not stage for stage in ranks) or flat != list(range(size)):
        return ranks, (
            f"stage_ranks {[list(r) for r in ranks]} must be non-empty lists that together hold every "
            f"group rank 0..{size - 1} exactly once (sum of stage tp sizes = {len(flat)}, group size {size})"
        )
    return ranks, None


def new_stage_groups(
    tp_sizes: Sequence[int], dp: int = 1, timeout: timedelta | None = None
) -> tuple[StageGroups, dist.ProcessGroup]:
    """Create the groups of ``dp`` pipeline replicas whose stages have tp sizes ``tp_sizes``.

    Collective over the default process group (``dist.new_group`` is), which must have
    ``dp * sum(tp_sizes)`` ranks laid out as ``rank = d * T + offset_s + i`` (replica ``d``,
    stage ``s`` starting at ``offset_s``, tp rank ``i``), the order of a ``(dp, pp, tp)``
    DeviceMesh when sizes are uniform.

    Args:
        tp_sizes: the tp size of each stage.
        dp: pipeline replicas.
        timeout: every new group's timeout; None: the default process group's
            (:func:`shardkit.comm._compat.world_timeout`; torch's own default for a subgroup is 30
            minutes on gloo, whatever the world's).

    Returns:
        ``(StageGroups, dp_group)``: this rank's stages and the ``dp`` ranks holding the same
        stage and tp rank in every replica (for gradient averaging).

    Raises:
        ShardkitError: sizes not ints >= 1, or ``dp * sum(tp_sizes)`` != the world size.
    """
    sizes = list(tp_sizes)
    if not sizes or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in sizes) or dp < 1:
        raise ShardkitError(f"new_stage_groups: tp_sizes must be ints >= 1 and dp >= 1, got {tp_sizes!r}, dp={dp}")
    T, world, me = sum(sizes), dist.get_world_size(), dist.get_rank()
    if T * dp != world:
        raise ShardkitError(f"new_stage_groups: dp={dp} x sum(tp_sizes {sizes}) = {T * dp} ranks, world has {world}")
    if timeout is None:
        timeout = world_timeout()
    offsets = split_offsets(sizes)
    mine = {}
    for d in range(dp):  # the same new_group calls in the same order on every rank
        pg = dist.new_group(list(range(d * T, (d + 1) * T)), timeout=timeout)
        for s, t in enumerate(sizes):
            tp = dist.new_group([d * T + offsets[s] + i for i in range(t)], timeout=timeout)
            if d * T + offsets[s] <= me < d * T + offsets[s] + t:
                mine = dict(pg=pg, tp=tp)
    # same calls on every rank
    dp_groups = [dist.new_group([d * T + k for d in range(dp)], timeout=timeout) for k in range(T)]
    stage_ranks = [[offsets[s] + i for i in range(t)] for s, t in enumerate(sizes)]
    return StageGroups(mine["pg"], stage_ranks, mine["tp"]), dp_groups[me % T]
