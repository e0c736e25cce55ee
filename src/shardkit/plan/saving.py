"""What a checkpoint save costs a training step (``shardkit train --checkpoint-dir``, and with
``--async-checkpoint``), per rank of the fullest pipeline stage.

A save holds, per parameter, the parameter (the float32 master under mixed precision), and
AdamW's two moments (float32, or the dtype when wider): ``3 x max(4, dtype bytes)`` bytes
(:mod:`shardkit.checkpoint.train_state`).

* **written** bytes per rank: the whole checkpoint over the GPUs (DCP writes each element once:
  replicas are deduplicated, FSDP2, tp, ep and pp ranks each write their own chunks), at
  :attr:`Cluster.checkpoint_gbps`;
* **staged** bytes per rank (``--async-checkpoint``): what the rank hands DCP, at
  :attr:`Cluster.host_gbps` into pinned memory: its tp / ep / pp local tensors (replicas
  included), under FSDP2 its shard of them (a save never all-gathers FSDP2 state,
  :mod:`shardkit.checkpoint.fsdp_shards`: ``1 / (dp_shard x cp)`` of the dense parameters, the
  first ``edp`` rank's rows of the expert weights, the parameters FSDP2 leaves out whole, as
  :func:`~.memory.memory_per_rank` holds them); under ZeRO the whole per-parameter moments (its
  flat-bucket slices are gathered first: a slice is no rectangular chunk of a parameter).

A synchronous save puts the write on the critical path: a saving step is longer by
``written / checkpoint_gbps``. An asynchronous one puts the staging copy there,
``staged / host_gbps``, and the write runs behind the next steps; only a write longer than the
steps until the next save shows, as that save's wait (``write - save_every x step``).

Not priced: ZeRO's all-gathers of the moments before a save (both modes; FSDP2 state is saved
as it is sharded, with no collective), and the checksums (read back and hashed: about one more
pass over the written bytes, behind the steps with ``--async-checkpoint``).

Source: DCP's save (deduplicated write items) and ``async_save`` (stage, then write in a
thread), as torchtitan uses them; the figures of :class:`~shardkit.plan.cluster.Cluster`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sharding import ParallelDims
from .cluster import Cluster
from .memory import _first_shard
from .model import ModelShape
from .options import StepOptions, expert_fsdp_ranks, hooked_params, resolve_options, stage_part, stage_tp

__all__ = ["SaveCost", "save_cost"]


@dataclass(frozen=True)
class SaveCost:
    """The price of one save, per rank (bytes, seconds).

    Attributes:
        written: bytes this rank writes (its share of the checkpoint).
        staged: bytes this rank copies to host memory (``--async-checkpoint``).
        write_s: seconds of the write.
        stage_s: seconds of the staging copy.
        critical_s: seconds a saving step takes longer than a plain one.
    """

    written: float
    staged: float
    write_s: float
    stage_s: float
    critical_s: float


def _saved_params(shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int) -> float:
    """Parameters a rank of ``stage`` saves (and stages): its local ones, under FSDP2 its shard
    (the split :func:`~.memory.memory_per_rank` holds between steps)."""
    dense, expert = shape.rank_params(stage_tp(dims, stage), dims.ep, part=stage_part(shape, dims, opts, stage))
    if dims.dp_shard == 1:
        return float(dense + expert)
    edp = expert_fsdp_ranks(dims)
    kept = hooked_params(shape, dims, opts, stage) + (expert if dims.ep > 1 and edp == 1 else 0)
    on_edp = expert if edp > 1 else 0  # expert weights sharded over edp, the rest over dp_shard x cp
    sharded = dense + expert - kept - on_edp
    return kept + sharded / (dims.dp_shard * dims.cp) + on_edp * _first_shard(shape, dims, edp)


def save_cost(
    shape: ModelShape,
    dims: ParallelDims,
    options: StepOptions,
    cluster: Cluster,
    *,
    asynchronous: bool,
    save_every: int | None = None,
    step_s: float | None = None,
) -> SaveCost:
    """The cost of a save of ``shape`` trained at ``dims`` on ``cluster``.

    Args:
        asynchronous: ``--async-checkpoint``: the staging copy is on the critical path, the
            write behind it.
        save_every: the steps between saves; with ``step_s``, an asynchronous write longer
            than ``save_every x step_s`` adds its excess (the next save waits for it).
        step_s: a plain step's seconds (used with ``save_every``).

    Returns:
        :class:`SaveCost` of the rank staging the most (the stage holding the most parameters).
    """
    opts = resolve_options(shape, dims, options)
    per = 3 * max(4, opts.elem)
    held = max(_saved_params(shape, dims, opts, stage) for stage in range(dims.pp))
    staged = float(held * per)
    written = shape.total_params * per / cluster.gpus
    write_s = written / (cluster.checkpoint_gbps * 1e9)
    stage_s = staged / (cluster.host_gbps * 1e9)
    if not asynchronous:
        return SaveCost(written, 0.0, write_s, 0.0, write_s)
    behind = save_every * step_s if save_every is not None and step_s is not None else float("inf")
    return SaveCost(written, staged, write_s, stage_s, stage_s + max(0.0, write_s - behind))
