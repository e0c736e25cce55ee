"""The pipeline side of ``shardkit train --pp P``: Llama stages x dp, one schedule per step.

Each rank holds one :class:`~shardkit.pipeline_parallel.DecoderStageModule` (stage =
its ``pp`` mesh coordinate). A step splits this dp rank's rows ``[B / dp, S]`` into ``M``
microbatches and runs the schedule table (1F1B or GPipe) with
:func:`~shardkit.pipeline_parallel.run_schedule`, which scales every microbatch loss by ``1 / M``.
After the pipeline flush the stage's gradients are averaged over its dp group with one
all-reduce (as Megatron-LM's ``finalize_model_grads``; DDP does not fit here: it would reduce
after every microbatch backward), so the gradients are those of the global-batch mean loss,
like the one-process reference. The step loss (mean over microbatches, then over dp) lives on
the last stage and is broadcast over pp so that global rank 0 reports it.

Tensor parallelism inside stages (``--pp N --tp T``, or ``--pp-tp 2,1,1`` with a tp size per
stage): a replica's ``sum(tp sizes)`` ranks are cut into stages in rank order, each stage's
ranks form its tp group (:func:`~shardkit.pipeline_parallel.vtp.new_stage_groups`) and hold a
Megatron-TP shard of the stage (:func:`shardkit.apply_tp` with the model's own plan);
activations cross stage boundaries replicated, leader to leader with a
broadcast inside the receiving stage when sizes differ, rank to rank when they match.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ParallelDims, all_reduce_forward
from ..pipeline_parallel import PipelineStage, gpipe_schedule, one_f_one_b_schedule, run_schedule, split_microbatches
from ..pipeline_parallel.hf_decoder import DecoderStageModule
from ..tensor_parallel import apply_tp
from ..pipeline_parallel.vtp import new_stage_groups
from .config import TrainConfig
from .data import local_rows
from .loop import average_grads, causal_lm_loss

__all__ = ["pipeline_mesh", "build_stage", "run_pipeline_steps", "gather_stage_params"]

_SCHEDULES = {"1f1b": one_f_one_b_schedule, "gpipe": gpipe_schedule}


def pipeline_mesh(cfg: TrainConfig, device_type: str):
    """The ``(dp, pp, cp, ep, tp)`` mesh of a pipeline run: ``pp x tp`` per replica, or, with
    ``--pp-tp`` (no rectangular ``pp x tp``), ``pp`` = the replica's ``sum(tp sizes)`` ranks.
    Only its ``dp`` dim is used with tp > 1 (the stage groups are built by :func:`build_stage`)."""
    tp = 1 if cfg.pp_tp is not None else cfg.tp
    return ParallelDims(dp=cfg.dp, pp=cfg.model_ranks // tp, tp=tp).build_mesh(device_type)


def build_stage(model, mesh, cfg: TrainConfig, device) -> PipelineStage:
    """This rank's stage of ``model`` (the full model; only the stage's modules are kept).

    Collective over the world when a stage has tp > 1 (it creates the stage groups)."""
    loss = lambda s: causal_lm_loss if s == cfg.pp - 1 else None  # noqa: E731  targets = the input ids
    if cfg.stage_tp_sizes == (1,) * cfg.pp:
        pp_mesh = mesh["pp"]
        s = pp_mesh.get_local_rank()
        module = DecoderStageModule(model, s, cfg.pp).to(device)
        return PipelineStage(module, pp_mesh, s, cfg.pp, loss_fn=loss(s))
    groups, _ = new_stage_groups(cfg.stage_tp_sizes, cfg.dp)
    s = groups.stage_index
    module = apply_tp(DecoderStageModule(model, s, cfg.pp).to(device), groups.tp_group, check="off")
    return PipelineStage(module, groups, s, cfg.pp, loss_fn=loss(s))


def run_pipeline_steps(stage: PipelineStage, optimizer, sampler, cfg: TrainConfig, mesh, device, on_step=None):
    """Train ``cfg.steps`` pipeline steps; return each step's global mean loss (on every rank).

    Collective over the whole world (every rank runs every step).
    """
    pp_mesh, dp_mesh = mesh["pp"], mesh["dp"]
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    table = _SCHEDULES[cfg.schedule](cfg.pp, cfg.microbatches)
    params = [p for p in stage.module.parameters() if p.requires_grad]
    last = stage.is_last
    losses = []
    for step in range(cfg.steps):
        ids = local_rows(sampler.next_batch(), dp_rank, dp).to(device)
        microbatches = split_microbatches(ids, cfg.microbatches)
        mb_losses = run_schedule(stage, table, microbatches, microbatches)
        average_grads(params, dp_mesh, "pp_dp_grads")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if last:
            loss = all_reduce_forward(torch.stack(mb_losses).mean(), dp_mesh) / dp
            loss = loss.to(torch.float64)
        else:
            loss = torch.zeros((), dtype=torch.float64, device=device)
        if stage.stages is None:
            dist.broadcast(loss, group=pp_mesh.get_group(), group_src=cfg.pp - 1)
        else:  # from the last stage's leader to every rank of the replica
            pg = stage.stages.info.pg
            dist.broadcast(loss, group=pg, src=dist.get_global_rank(pg, stage.stages.stage_ranks[-1][0]))
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def gather_stage_params(stage: PipelineStage, mesh) -> dict | None:
    """Full model's parameters ``{name: tensor}`` on global rank 0 (None elsewhere).

    Collective over the world: the tp shards of a stage are all-gathered inside it, then its
    leader on dp rank 0 sends the stage's parameters (already named like the full model's) with
    one ``gather_object``.
    """
    from ..tensor_parallel import gather_full_state_dict

    mine = {}
    params = gather_full_state_dict(stage.module) if stage.tp_size > 1 else None
    if mesh["dp"].get_local_rank() == 0 and (stage.stages is None or stage.stages.is_leader):
        params = params or {name: p.detach() for name, p in stage.module.named_parameters()}
        mine = {name: p.cpu() for name, p in params.items()}
    rank = dist.get_rank()
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    if rank != 0:
        return None
    full = {}
    for part in parts:
        full.update(part)
    return full
