"""``parallelize_stage``: cut a decoder into pipeline stages, then parallelize this rank's stage.

The stage is cut first (its layers, plus the embedding on the first stage and the final norm and
``lm_head`` on the last), keeping the full model's parameter names; then the same
:func:`~.decoder.parallelize` as without a pipeline applies tp, cp, ep and dp to it on the
stage's submeshes. Stages exchange hidden states over ``mesh["pp"]`` (each tp rank with the
same tp rank of the next stage, Megatron-LM's pp x tp), or, for a ``pp_tp`` layout with a tp
size per stage, through :class:`~shardkit.pipeline_parallel.StageGroups` (leader to leader,
then a broadcast inside the stage: MindSpeed-MM's VTP). Under sequence parallelism each tp rank
sends its own sequence block (``sp_boundary="shard"``, Megatron-LM's), not the gathered sequence.

Source: torchtitan's ``pipeline_llama`` (cut, then ``parallelize_llama`` per stage);
Megatron-LM pipeline x tensor parallelism; MindSpeed-MM VTP.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..data_parallel import GradReduce
from ..errors import ShardkitError
from ..pipeline_parallel import PipelineStage
from ..pipeline_parallel.tables import SCHEDULES
from .ac_policy import ACPolicy
from .decoder import ParallelModel, parallelize
from .decoder_stages import DecoderStageModule, sum_tied_embedding_grads

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
    activation_checkpoint: str | ACPolicy = "none",
    mixed_precision: str = "none",
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    compile: bool | str = False,
    zero: int = 0,
    cp_layout: str = "zigzag",
    sp_activation: str | None = None,
    expert_capacity: dict[str, Any] | None = None,
    sp_boundary: str = "shard",
    async_tp: bool = False,
) -> ParallelModel:
    """This rank's pipeline stage of ``model``, parallelized, with its :class:`PipelineStage`.

    Args:
        model: the full causal LM (same weights on every rank); only the stage's modules are
            kept once it is dropped.
        mesh: the job's :class:`~shardkit.sharding.ParallelMesh` with ``pp > 1``.
        loss_fn: ``loss_fn(logits, labels) -> 0-d`` for the last stage.
        sequence_parallel: as :func:`~.decoder.parallelize`.
        loss_parallel: as :func:`~.decoder.parallelize`.
        activation_checkpoint: as :func:`~.decoder.parallelize`.
        mixed_precision: as :func:`~.decoder.parallelize` (with ``"bf16"`` the stages exchange
            bfloat16 hidden states).
        compile: as :func:`~.decoder.parallelize`.
        zero: as :func:`~.decoder.parallelize` (ZeRO over this stage's data ranks).
        cp_layout: as :func:`~.decoder.parallelize`.
        sp_activation: as :func:`~.decoder.parallelize`.
        expert_capacity: as :func:`~.decoder.parallelize`.
        sp_boundary: with ``sequence_parallel`` and tp > 1, what crosses a stage boundary:
            ``"shard"`` (default; Megatron-LM's) each tp rank's sequence block ``[b, S_r, H]``,
            sent to the same tp rank of the next stage, whose first layer takes it as its
            sequence-parallel input (``run_schedule`` then needs ``seq_len`` or ``position_ids``
            in every microbatch's ``stage_kwargs``: :class:`DecoderStageModule`); ``"gathered"``
            the replicated ``[b, S, H]`` (all-gathered after a chunk's last layer, split again
            before the next one's first). ``pp_tp`` stages (tp sizes per stage) always exchange
            replicated tensors (the VTP reshard between stages of different tp sizes).
        async_tp: as :func:`~.decoder.parallelize`.
        grad_reduce: as :func:`~.decoder.parallelize` (over the data ranks of this stage; the
            schedule's microbatch losses are ``loss_fn``'s to scale).
        schedule: the pipeline schedule (a name of
            :data:`~shardkit.pipeline_parallel.tables.SCHEDULES`): it places the chunks.
        virtual_stages: chunks per rank. With ``v > 1`` or a schedule other than ``1f1b`` and
            ``gpipe`` the stage holds the ``v`` chunk modules (every schedule), else the stage's
            module (every one-chunk schedule, ``pp_tp`` stages included): a
            :class:`PipelineStage` either way.

    Returns:
        :class:`~.decoder.ParallelModel` whose ``stage`` runs the schedule.

    Raises:
        ShardkitError: an unknown ``schedule`` or ``sp_boundary``; ``virtual_stages > 1`` with ``pp_tp`` stages; fewer
            layers than ``pp x virtual_stages`` (:class:`DecoderStageModule`).
    """
    dims = mesh.dims
    stages = mesh["stages"] if dims.pp_tp is not None else None
    s = stages.stage_index if stages is not None else mesh.local_rank("pp")
    if schedule not in SCHEDULES:
        raise ShardkitError(
            f"parallelize_stage: unknown pipeline schedule {schedule!r}; expected one of {list(SCHEDULES)}"
        )
    # a tp-group stage is a one-chunk PipelineStage: every one-chunk schedule runs on it
    chunked = stages is None and (virtual_stages > 1 or schedule not in ("1f1b", "gpipe"))
    if stages is not None and virtual_stages != 1:
        raise ShardkitError(
            f"parallelize_stage: pp_tp stages hold one chunk each, got schedule {schedule!r} "
            f"with {virtual_stages} virtual stages"
        )
    if sp_boundary not in ("shard", "gathered"):
        raise ShardkitError(f"parallelize_stage: sp_boundary must be 'shard' or 'gathered', got {sp_boundary!r}")
    placement = SCHEDULES[schedule].placement
    module = DecoderStageModule(model, s, dims.pp, virtual_stages=virtual_stages, placement=placement)
    if sequence_parallel and dims.tp > 1 and stages is None:  # pp_tp: replicated (see sp_boundary)
        module.sp_boundary = sp_boundary
    pm = parallelize(
        module,
        mesh,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        grad_reduce=grad_reduce,
        activation_checkpoint=activation_checkpoint,
        mixed_precision=mixed_precision,
        compile=compile,
        zero=zero,
        cp_layout=cp_layout,
        sp_activation=sp_activation,
        expert_capacity=expert_capacity,
        async_tp=async_tp,
    )
    last = module.is_last
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
    if chunked:
        chunks = [module.chunk_module(c) for c in range(virtual_stages)]
        pm.stage = PipelineStage(chunks, mesh["pp"], loss_fn=loss_fn if last else None, placement=placement)
        return pm
    pm.stage = PipelineStage(
        pm.module, stages if stages is not None else mesh["pp"], s, dims.pp, loss_fn=loss_fn if last else None
    )
    return pm
