"""Memory per rank of a layout: parameters, gradients, optimizer state, activations.

* parameters and gradients in the training dtype; AdamW's two moments in float32, plus a
  float32 master copy when the dtype is narrower (mixed precision: 2 + 2 + 12 bytes per bf16
  parameter, Rajbhandari et al., ZeRO);
* FSDP2 (``dp_shard``) shards all three over ``dp_shard x cp`` except the parameters it leaves to
  shardkit's reductions, and the expert weights of ``ep > 1`` over their ``edp`` ranks (whole
  when ``edp`` is 1; gathered with their layer; the first rank's share of uneven rows); the
  root's parameters (embedding, final norm, ``lm_head``) stay gathered from forward through
  backward (FSDP2 does not reshard its root after forward) and the largest decoder layer is
  gathered at a time (their full sizes added; checked against the real model on a fake world by
  :mod:`shardkit.parallelize.fake_world`); with ``M > 1`` microbatches the whole stage stays
  gathered for the step and its gradients accumulate unsharded until the step's one
  reduce-scatter (:func:`shardkit.data_parallel.set_microbatch`);
* activations per layer and microbatch: the bytes shardkit's decoder block keeps for backward
  under the run's activation checkpointing (:mod:`.activations`, checked against the measured
  count), plus, when blocks are checkpointed, one block's full set during its recompute; the
  logits ``b x S x V / t`` in float32 on the rank of the last chunk (the last stage; rank 0 with
  the V-shaped schedules); a stage holds its schedule's peak in-flight microbatch-chunks
  (:func:`.pipeline.peak_chunks`: 1F1B ``min(M, pp - stage)``, GPipe ``M``, ...) of ``1 / v`` of
  its layers each;
* with ``pp_tp`` each stage is cut over its own tp size;
* ZeRO-1 / ZeRO-2 (``opts.zero``): AdamW's state for ``1 / R`` of each flat bucket (padded to
  ``R``; dense over ``dp_replicate x cp``, experts over ``edp``); parameters whole; gradients whole
  too, for both stages: the peak is the end of backward, before the step's one reduce-scatter
  (both stages run it there and free the full gradient; ``data_parallel/zero.py`` says why a
  step of ``M`` accumulated microbatches cannot free it earlier at the same traffic).
"""

from __future__ import annotations

import math

from ..pipeline_parallel.tables import SCHEDULES
from ..sharding import ParallelDims
from .activations import BlockLayout, block_saved_bytes, stage_saved_bytes
from .model import ModelShape
from .options import (
    StepOptions,
    expert_fsdp_ranks,
    fsdp_once_per_step,
    hooked_params,
    resolve_options,
    stage_part,
    stage_tp,
    zero_buckets,
)
from .pipeline import peak_chunks

__all__ = ["memory_per_rank"]


def _gathered(
    shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int, sharded: float, kept: float
) -> float:
    """Elements FSDP2 holds unsharded at the peak of a step on ``stage``: its root's (the
    non-layer parameters, less the final norm kept with sequence parallelism) plus the largest
    decoder layer's (its share of the kept parameters taken as the layers' average)."""
    tp = stage_tp(dims, stage)
    layers, _, last = stage_part(shape, dims, opts, stage)
    parts = [shape.layer_params(i, tp, dims.ep) for i in layers]
    whole = dims.ep > 1 and expert_fsdp_ranks(dims) == 1  # experts kept whole, never gathered
    sizes = [d + (0 if whole else e) for d, e in parts]
    final_norm = shape.hidden if opts.sequence_parallel and tp > 1 and last else 0
    layers_kept = kept - (sum(e for _, e in parts) if whole else 0) - final_norm
    root = sharded - (sum(sizes) - layers_kept)
    return root + max(sizes, default=0) - layers_kept / max(1, len(sizes))


def _first_shard(shape: ModelShape, dims: ParallelDims, edp: int) -> float:
    """The share of a rank's expert rows (``E / ep``) the first ``edp`` rank holds: FSDP2 cuts dim 0
    like ``torch.chunk``, and few experts per rank over many ``edp`` ranks is the common case (the
    largest shard, not the even ``1 / edp``)."""
    rows = shape.experts // dims.ep
    return math.ceil(rows / edp) / rows if rows else 0.0


def memory_per_rank(shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int = 0) -> dict[str, float]:
    """Bytes held by one rank of pipeline stage ``stage`` at the peak of a step.

    Returns:
        ``{"params", "grads", "optimizer", "activations", "total"}`` in bytes.
    """
    opts = resolve_options(shape, dims, opts)
    e, tp = opts.elem, stage_tp(dims, stage)
    dense, expert = shape.rank_params(tp, dims.ep, part=stage_part(shape, dims, opts, stage))
    params = dense + expert
    if dims.dp_shard > 1:
        edp = expert_fsdp_ranks(dims)
        kept = hooked_params(shape, dims, opts, stage) + (expert if dims.ep > 1 and edp == 1 else 0)
        sharded = params - kept
        on_edp = expert if edp > 1 else 0  # expert weights sharded over edp, the rest over dp_shard x cp
        held = kept + (sharded - on_edp) / (dims.dp_shard * dims.cp) + on_edp * _first_shard(shape, dims, edp)
        if fsdp_once_per_step(dims, opts):
            # set_microbatch: the stage stays unsharded from the first forward to the last
            # backward, and its gradients accumulate unsharded until the one reduce-scatter
            gathered, unsharded_grads = float(sharded), float(sharded)
        else:
            gathered, unsharded_grads = _gathered(shape, dims, opts, stage, sharded, kept), 0.0
    else:
        held, gathered, unsharded_grads = float(params), 0.0, 0.0
    stepped = held
    if opts.zero:  # ZeRO: AdamW's state for this rank's slice of each padded bucket only
        stepped = sum(n // r for n, r in zero_buckets(shape, dims, opts, stage))
    optimizer = stepped * (8 + (4 if e < 4 else 0))
    b = opts.global_batch // (dims.dp * opts.microbatches)
    sp = bool(opts.sequence_parallel)
    where = BlockLayout(b, opts.seq_len, tp, dims.cp_ulysses, dims.cp_ring, sp, opts.sp_activation)
    layers = len(shape.stage_layers(dims.pp, stage))
    saved = stage_saved_bytes(shape, where, opts.activation_checkpoint, e, layers)  # every block of the stage
    v = opts.virtual_stages if dims.pp > 1 else 1
    in_flight = 1 if dims.pp == 1 else peak_chunks(opts.schedule, dims.pp, v, opts.microbatches, stage)
    acts = saved / v * in_flight  # chunks of 1/v of the stage
    if opts.activation_checkpoint != "none":  # backward recomputes one block at a time
        acts += block_saved_bytes(shape, where, "none", e)
    S = opts.seq_len // dims.cp
    v_shaped = dims.pp > 1 and SCHEDULES[opts.schedule].placement == "v"
    if stage == (0 if v_shaped else dims.pp - 1):
        acts += b * S * shape.vocab / tp * 4 * 2  # logits and their gradient, float32
    out = dict(params=(held + gathered) * e, grads=(held + unsharded_grads) * e, optimizer=optimizer, activations=acts)
    out["total"] = sum(out.values())
    return out
