"""Memory per rank of a layout: parameters, gradients, optimizer state, activations.

* parameters and gradients in the training dtype; AdamW's two moments in float32, plus a
  float32 master copy when the dtype is narrower (mixed precision: 2 + 2 + 12 bytes per bf16
  parameter, Rajbhandari et al., ZeRO);
* FSDP2 (``dp_shard``) shards all three over ``dp_shard x cp`` except the parameters it leaves to
  shardkit's reductions; one decoder layer is gathered at a time (its full size added);
* activations per layer and microbatch ``34 x b x S x H`` bytes at 16 bits, divided by tp with
  sequence parallelism and by cp (Korthikanti et al., 2022; flash attention: no ``S^2`` term),
  scaled by the dtype; the logits ``b x S x V / t`` in float32 on the rank of the last chunk (the
  last stage; rank 0 with the V-shaped schedules); a stage holds its schedule's peak in-flight
  microbatch-chunks (:func:`.pipeline.peak_chunks`: 1F1B ``min(M, pp - stage)``, GPipe ``M``, ...)
  of ``1 / v`` of its layers each;
* with ``pp_tp`` each stage is cut over its own tp size.
"""

from __future__ import annotations

from ..pipeline_parallel.tables import SCHEDULES
from ..sharding import ParallelDims
from .model import ModelShape
from .options import StepOptions, hooked_params, resolve_options, stage_tp
from .pipeline import peak_chunks

__all__ = ["memory_per_rank"]


def memory_per_rank(shape: ModelShape, dims: ParallelDims, opts: StepOptions, stage: int = 0) -> dict[str, float]:
    """Bytes held by one rank of pipeline stage ``stage`` at the peak of a step.

    Returns:
        ``{"params", "grads", "optimizer", "activations", "total"}`` in bytes.
    """
    opts = resolve_options(shape, dims, opts)
    e, tp = opts.elem, stage_tp(dims, stage)
    dense, expert = shape.rank_params(tp, dims.ep, dims.pp, stage)
    params = dense + expert
    if dims.dp_shard > 1:
        kept = hooked_params(shape, dims, opts, stage) + (expert if dims.ep > 1 else 0)
        sharded = params - kept
        layers = max(1, len(shape.stage_layers(dims.pp, stage)))
        gathered = sharded / layers  # one layer unsharded at a time
        held = kept + sharded / (dims.dp_shard * dims.cp)
    else:
        held, gathered = params, 0.0
    optimizer = held * (8 + (4 if e < 4 else 0))
    b = opts.global_batch // (dims.dp * opts.microbatches)
    S = opts.seq_len // dims.cp
    per_layer = 34 * b * S * shape.hidden / 2 * e
    if opts.sequence_parallel:
        per_layer /= tp
    v = opts.virtual_stages if dims.pp > 1 else 1
    in_flight = 1 if dims.pp == 1 else peak_chunks(opts.schedule, dims.pp, v, opts.microbatches, stage)
    acts = per_layer * len(shape.stage_layers(dims.pp, stage)) / v * in_flight  # chunks of 1/v of the stage
    v_shaped = dims.pp > 1 and SCHEDULES[opts.schedule].placement == "v"
    if stage == (0 if v_shaped else dims.pp - 1):
        acts += b * S * shape.vocab / tp * 4 * 2  # logits and their gradient, float32
    out = dict(params=(held + gathered) * e, grads=held * e, optimizer=optimizer, activations=acts)
    out["total"] = sum(out.values())
    return out
