"""The validation loss of ``shardkit train --eval-every N --eval-batches K``.

The held-out batches (:class:`.data.HeldOutBatches`) go through the training loss path of
every layout: this rank's data-parallel rows in ``M`` microbatches, the task's ``prepare``
(cp shards), ``forward`` and ``loss_sum`` (vocab-parallel with ``--loss-parallel``), the global
sum of the counted ranks divided by the global target count. So the value is the global mean
next-token loss of the same tokens whatever the layout, equal to the one-process value.

The model runs in eval mode under ``torch.no_grad``; with ``pp > 1`` the schedule runs its
forward-only table (``run_schedule(..., train=False)``: the forwards of every microbatch in the
schedule's order, no backward, no gradient message), so validating costs the forwards only.
"""

from __future__ import annotations

import torch

# The step's own loss arithmetic (which ranks count, the world sum, the schedule's loss sum),
# shared rather than repeated so validation and training can never count differently.
from .trainer import LossScale, _counts_loss, _global_sum, _pipeline_backward

__all__ = ["eval_loss"]


def eval_loss(pm, task, microbatches: int, schedule: str, loss_scale: LossScale | None = None) -> float:
    """Mean next-token loss over the task's held-out batches (``task.held_out``); the same on every rank.

    Args:
        pm: the :class:`~shardkit.parallelize.ParallelModel` (``pm.mesh`` None: one process).
        task: an :class:`.lm_task.LMTask` with ``held_out``.
        microbatches: as the training step's (``--microbatches``).
        schedule: as the training step's (``--schedule``).
        loss_scale: the pipeline's loss function (with ``pp > 1``).

    Collective over the world.
    """
    mesh = pm.mesh
    dp, dp_rank = (1, 0) if mesh is None else (mesh.size("dp"), mesh.local_rank("dp"))
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    was_training = pm.module.training
    pm.module.eval()
    try:
        for ids in task.held_out.batches():
            batch = (ids, None)
            count += task.count(batch)
            mbs = task.microbatches(batch, dp_rank, dp, microbatches)
            if pm.stage is None:
                with torch.no_grad():
                    for mb in mbs:
                        inputs, targets = task.prepare(mb, pm)
                        total += task.loss_sum(task.forward(pm.module, inputs), targets, pm).to(torch.float64).cpu()
            else:
                assert loss_scale is not None  # the pipeline is built with its loss
                loss_scale.scale = 1.0
                with torch.no_grad():
                    total += _pipeline_backward(pm, task, mbs, schedule, loss_scale, train=False).cpu()
    finally:
        pm.module.train(was_training)
    contribution = total if _counts_loss(pm) else torch.zeros_like(total)
    device = next(pm.module.parameters()).device
    return _global_sum(contribution.to(device), pm) / count
