"""``parallelize_stage``: cut a decoder into pipeline stages, then parallelize this rank's stage.

The stage is cut first (its layers, plus the embedding on the first stage and the final norm and
``lm_head`` on the last), keeping the full model's parameter names; then the same
:func:`~.decoder.parallelize` as without a pipeline applies tp, cp, ep and dp to it on the
stage's submeshes. Stages exchange hidden states over ``mesh["pp"]`` (each tp rank with the
same tp rank of the next stage, Megatron-LM's pp x tp), or, for a ``pp_tp`` layout with a tp
size per stage, through :class:`~shardkit.pipeline_parallel.StageGroups` (leader to leader,
then a broadcast inside the stage: MindSpeed-MM's VTP).

Source: torchtitan's ``pipeline_llama`` (cut, then ``parallelize_llama`` per stage);
Megatron-LM pipeline x tensor parallelism; MindSpeed-MM VTP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..data_parallel import GradReduce
from ..errors import ShardkitError
from ..pipeline_parallel import DecoderStageModule, PipelineStage, sum_tied_embedding_grads
from .decoder import ParallelModel, parallelize

if TYPE_CHECKING:
    from ..sharding import ParallelMesh

__all__ = ["parallelize_stage"]


def parallelize_stage(
    model: nn.Module,
    mesh: ParallelMesh,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    grad_reduce: GradReduce = "mean",
    activation_checkpoint: str = "none",
    compile: bool | str = False,
) -> ParallelModel:
    """This rank's pipeline stage of ``model``, parallelized, with its :class:`PipelineStage`.

    Args:
        model: the full causal LM (same weights on every rank); only the stage's modules are
            kept once it is dropped.
        mesh: the job's :class:`~shardkit.sharding.ParallelMesh` with ``pp > 1``.
        loss_fn: ``loss_fn(logits, labels) -> 0-d`` for the last stage.
        sequence_parallel, loss_parallel, activation_checkpoint, compile: as :func:`~.decoder.parallelize`.
        grad_reduce: as :func:`~.decoder.parallelize` (over the data ranks of this stage; the
            schedule's microbatch losses are ``loss_fn``'s to scale).

    Returns:
        :class:`~.decoder.ParallelModel` whose ``stage`` runs the schedule.
    """
    dims = mesh.dims
    stages = mesh["stages"] if dims.pp_tp is not None else None
    s = stages.stage_index if stages is not None else mesh.local_rank("pp")
    module = DecoderStageModule(model, s, dims.pp)
    pm = parallelize(
        module,
        mesh,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        grad_reduce=grad_reduce,
        activation_checkpoint=activation_checkpoint,
        compile=compile,
    )
    last = s == dims.pp - 1
    if module.tied:
        # embed_tokens (first stage) and lm_head (last) are copies of one weight: their gradients
        # are summed between the two stages before the data-parallel reduction, and the last
        # stage's copy is left out of the norm and the gathered parameters.
        if stages is not None:
            raise ShardkitError(
                "parallelize_stage: tied input/output embeddings with pp_tp stages (different tp "
                "sizes cut the two copies differently); untie them or use equal tp sizes"
            )
        pm.grads.pre_reduce = lambda: sum_tied_embedding_grads(module, mesh["pp"])
        if last:
            pm.layouts["lm_head.weight"].copy = True
    pm.stage = PipelineStage(
        pm.module, stages if stages is not None else mesh["pp"], s, dims.pp, loss_fn=loss_fn if last else None
    )
    return pm
