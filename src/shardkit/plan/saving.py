"""What a checkpoint save costs a training step (``shardkit train --checkpoint-dir``, and with
``--async-checkpoint``), per rank of the fullest pipeline stage.

A save holds, per parameter, the parameter (the float32 master under mixed precision), and
AdamW's two moments (float32, or the dtype when wider): ``3 x max(4, dtype bytes)`` bytes
(:mod:`shardkit.checkpoint.train_state`).

* **written** bytes per rank: the whole checkpoint over the GPUs (DCP writes each element once:
  replicas are deduplicated, FSDP2, tp, ep and pp ranks each write their own chunks), at
  :attr:`Cluster.checkpoint_gbps`;
* **staged** bytes per rank (``--async-checkpoint``): the rank's own state before FSDP2 or ZeRO
  sharding (every rank copies what it would hand DCP: tp / ep / pp local tensors, replicas
  included), at :attr:`Cluster.host_gbps` into pinned memory.

A synchronous save puts the write on the critical path: a saving step is longer by
``written / checkpoint_gbps``. An asynchronous one puts the staging copy there,
``staged / host_gbps``, and the write runs behind the next steps; only a write longer than the
steps until the next save shows, as that save's wait (``write - save_every x step``).

Not priced: the all-gathers that build the state (FSDP2 parameters and moments, ZeRO's
moments), in both modes, and the checksums (read back and hashed: about one more pass over the
written bytes, behind the steps with ``--async-checkpoint``).

Source: DCP's save (deduplicated write items) and ``async_save`` (stage, then write in a
thread), as torchtitan uses them; the figures of :class:`~shardkit.plan.cluster.Cluster`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sharding import ParallelDims
from .cluster import Cluster
from .model import ModelShape
from .options import StepOptions, resolve_options, stage_part, stage_tp

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
    held = 0
    for stage in range(dims.pp):
        dense, expert = shape.rank_params(stage_tp(dims, stage), dims.ep, part=stage_part(shape, dims, opts, stage))
        held = max(held, dense + expert)
    staged = float(held * per)
    written = shape.total_params * per / cluster.gpus
    write_s = written / (cluster.checkpoint_gbps * 1e9)
    stage_s = staged / (cluster.host_gbps * 1e9)
    if not asynchronous:
        return SaveCost(written, 0.0, write_s, 0.0, write_s)
    behind = save_every * step_s if save_every is not None and step_s is not None else float("inf")
    return SaveCost(written, staged, write_s, stage_s, stage_s + max(0.0, write_s - behind))
