"""The planner prices the routed experts as shardkit runs them: one grouped GEMM per projection,
each expert's rows in whole tiles (:mod:`shardkit.plan.moe_time`), no per-expert launch term.

By hand: the rows a local expert gets per microbatch for each kind of layout, the tile waste,
and ``estimate_step``'s compute time, which must be the model FLOPs plus exactly the partial
tiles' FLOPs (and nothing more for a dense model, or when every expert fills whole tiles).
"""

import pytest

from shardkit import Cluster, ModelShape, ParallelDims, StepOptions, estimate_step
from shardkit.plan.moe_time import (
    TILE_ROWS,
    expert_flops_per_token,
    grouped_gemm_extra_flops,
    rows_per_expert,
    tile_waste,
)

MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}
DENSE = {k: v for k, v in MOE.items() if k not in ("moe_intermediate_size", "num_experts", "num_experts_per_tok")}
DENSE["model_type"] = "llama"


def test_rows_per_expert_by_layout():
    shape = ModelShape.from_config(MOE)
    opts = StepOptions(seq_len=256, global_batch=8, microbatches=2, dtype="float32")
    # dp=4: 2 sequences per rank, 1 per microbatch: 256 tokens x top-2 over 8 experts
    assert rows_per_expert(shape, ParallelDims(dp_replicate=4), opts) == 256 * 2 / 8
    # tensor-parallel experts: every tp rank routes the whole microbatch to all 8 experts
    assert rows_per_expert(shape, ParallelDims(dp_replicate=2, tp=2), opts) == 2 * 256 * 2 / 8
    # ep=4 borrowed from tp=2 x dp_shard=2: each tp rank dispatches half; 2 experts per rank
    # receive the pairs of 4 ranks
    assert rows_per_expert(shape, ParallelDims(dp_shard=2, tp=2, ep=4), opts) == 2 * 256 / 2 * 2 * 4 / 8
    # cp=4: each rank routes a quarter of the sequence
    assert rows_per_expert(shape, ParallelDims(cp_ring=4), opts) == 8 * 256 / 2 / 4 * 2 / 8
    assert rows_per_expert(ModelShape.from_config(DENSE), ParallelDims(dp_replicate=4), opts) == 0.0


def test_tile_waste():
    assert tile_waste(TILE_ROWS) == 1.0 and tile_waste(4 * TILE_ROWS) == 1.0
    assert tile_waste(16) == TILE_ROWS / 16  # one whole tile for 16 rows
    assert tile_waste(TILE_ROWS + 1) == 2 * TILE_ROWS / (TILE_ROWS + 1)
    assert tile_waste(0) == 1.0


@pytest.mark.parametrize(
    ("dims", "rows"),
    [
        (ParallelDims(dp_replicate=4), 64.0),  # half a tile per expert: the experts cost twice their FLOPs
        (ParallelDims(dp_shard=2, tp=2, ep=4), 256.0),  # two whole tiles: no extra
        (ParallelDims(cp_ring=4), 64.0),
    ],
)
def test_compute_time_is_model_flops_plus_partial_tiles(dims, rows):
    shape = ModelShape.from_config(MOE)
    opts = StepOptions(seq_len=256, global_batch=8, microbatches=2, dtype="float32")
    assert rows_per_expert(shape, dims, opts) == rows
    cluster = Cluster(gpus=4, gpus_per_node=4)
    tokens = 8 * 256
    # the experts' share of the 6 N FLOPs: 4 layers x top-2 x 3 x H x F_e
    assert expert_flops_per_token(shape) == 6 * 4 * 2 * 3 * 64 * 32
    extra = expert_flops_per_token(shape) * (TILE_ROWS / rows - 1) if rows < TILE_ROWS else 0.0
    assert grouped_gemm_extra_flops(shape, dims, opts) == extra
    work = (shape.flops_per_token(256) + extra) * tokens
    est = estimate_step(shape, dims, opts, cluster)
    assert est.compute_s == pytest.approx(work / 4 / (cluster.peak_tflops * 1e12 * cluster.efficiency), rel=1e-12)
    # the MFU counts the model FLOPs only: partial tiles are waste, not useful work
    assert est.mfu == pytest.approx(shape.flops_per_token(256) * tokens / (est.step_s * 4 * cluster.peak_tflops * 1e12))


def test_dense_models_are_unchanged():
    shape = ModelShape.from_config(DENSE)
    opts = StepOptions(seq_len=256, global_batch=8, dtype="float32")
    assert grouped_gemm_extra_flops(shape, ParallelDims(dp_replicate=4), opts) == 0.0
    est = estimate_step(shape, ParallelDims(dp_replicate=4), opts, Cluster(gpus=4, gpus_per_node=4))
    cluster = Cluster(gpus=4)
    assert est.compute_s == pytest.approx(
        shape.flops_per_token(256) * 8 * 256 / 4 / (cluster.peak_tflops * 1e12 * cluster.efficiency), rel=1e-12
    )
