"""The routed experts' GEMM time as shardkit runs them: one grouped GEMM per projection.

shardkit's local experts are never a loop of per-expert GEMMs: every projection of all of a
rank's experts is one ``torch._grouped_mm`` (:mod:`shardkit._grouped_gemm`), so an MoE layer
costs 2 launches (the gated first projection, ``down_proj``) per pass and microbatch, however
many experts a rank holds: no per-expert term. What a grouped GEMM pays beyond its FLOPs is
tile quantization: the kernel cuts each expert's rows into tiles of :data:`TILE_ROWS` rows
(CUTLASS's grouped-GEMM schedule: a tile never spans two groups), so an expert with ``r`` rows
costs ``ceil(r / TILE_ROWS)`` whole tiles. With tokens routed evenly (the balancing's aim) a
local expert gets, per microbatch,

    ``r = T_rank * k * ep / E``

rows: ``T_rank`` tokens routed by each rank (the microbatch's tokens over ``dp x cp``, and
over ``tp`` with expert parallelism, where each tp rank dispatches its own block; tensor-parallel
experts, ``ep = 1``, route the whole microbatch on every tp rank, each expert's width cut over
tp), ``k`` experts per token, ``E / ep`` experts per rank. The planner prices the routed experts'
``6 x`` active parameters per token times ``ceil(r / TILE_ROWS) x TILE_ROWS / r`` (1 when ``r``
fills whole tiles; 8 at 16 rows, as tensor-parallel experts of a long cp-sharded sequence see).
The padded ``bmm`` fallback (builds without ``_grouped_mm``) pads to the largest expert instead:
the same under even routing, and the planner models GPUs with the kernel.

Source: shardkit's grouped GEMM (Megatron-LM ``GroupedMLP`` / torchtitan's grouped experts);
NVIDIA CUTLASS grouped GEMM (per-group tiling).
"""

from __future__ import annotations

import math

from ..sharding import ParallelDims
from .model import ModelShape
from .options import StepOptions

__all__ = ["TILE_ROWS", "rows_per_expert", "tile_waste", "expert_flops_per_token", "grouped_gemm_extra_flops"]

TILE_ROWS = 128
"""Rows of one grouped-GEMM tile (an assumption of the model: CUTLASS's usual M tile on Hopper)."""


def rows_per_expert(shape: ModelShape, dims: ParallelDims, options: StepOptions) -> float:
    """Rows one local expert's GEMMs take per microbatch under even routing (module docstring)."""
    if not shape.experts:
        return 0.0
    tokens = options.global_batch * options.seq_len / (dims.dp * options.microbatches * dims.cp)
    if dims.ep > 1:
        tokens /= dims.tp  # each tp rank dispatches its own block of the (replicated) tokens
    return tokens * shape.top_k * dims.ep / shape.experts


def tile_waste(rows: float) -> float:
    """``ceil(r / TILE_ROWS) x TILE_ROWS / r``: the tile rows computed per useful row (>= 1; 1 at 0 rows)."""
    if rows <= 0:
        return 1.0
    return math.ceil(rows / TILE_ROWS - 1e-9) * TILE_ROWS / rows


def expert_flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token of the routed experts' GEMMs: ``6 x k x 3 H F_e`` per MoE layer."""
    return 6.0 * shape.moe_layers * shape.top_k * 3 * shape.hidden * shape.moe_ffn


def grouped_gemm_extra_flops(shape: ModelShape, dims: ParallelDims, options: StepOptions) -> float:
    """FLOPs per token the grouped GEMMs' partial tiles add to :meth:`ModelShape.flops_per_token`
    (the work the GPU does beyond the model FLOPs; 0 for a dense model)."""
    if not shape.experts:
        return 0.0
    return expert_flops_per_token(shape) * (tile_waste(rows_per_expert(shape, dims, options)) - 1.0)
