"""The planner's params, grads and optimizer rows against the real parallelized model on a fake
world of a few hundred ranks (:mod:`shardkit.parallelize.fake_world`: torch's fake process group,
the model on the meta device, one rank per pipeline stage built and counted in this process),
and the same count on a real 4-rank gloo world with real tensors (what the fake world stands in
for).

Tolerances, and why the counts can differ at all:

* Llama, Qwen2 and the real world (every size divides its ranks evenly): equal to the element (relative 1e-9, float
  rounding of the planner's divisions). Before this check the planner divided the FSDP2-sharded
  parameters by the layer count for the gathered term; FSDP2 keeps its root (embedding, final
  norm, ``lm_head``) gathered from forward through backward, so the first and last stages'
  params row was low (by 23 % and 18 % here, a third at tp 8 x pp 16 x dp_shard 128; fixed in
  ``plan/memory.py``).
* MoE with ep (relative 1e-3): FSDP2 cuts dim 0 like ``torch.chunk``, so when a parameter has
  fewer rows than data ranks or rows not divisible by them, the sampled first data rank holds a
  whole row where the planner counts the even fraction. DeepSeek's first stage at dp_shard 128:
  the routers' 32 rows (rank 0 holds 1 row, the plan 0.25: 2 x 5376 elements) and
  ``kv_a_proj_with_mqa``'s 576 rows (5 against 4.5: 3 x 3584), 21504 elements more than the
  planned 1.9e8 (1.1e-4). Qwen3-MoE's sizes divide evenly: equal. The expert weights, FSDP2-sharded
  over ``edp`` (8 ranks in both), are planned as the first rank's shard: DeepSeek's 2 experts per
  ep rank leave rank 0 one of them (a half, not an eighth).
"""

import json

import pytest
import torch.distributed as dist
import transformers

from harness.helpers import all_true
from harness.tiny_lm import loss_sum, tiny_decoder
from shardkit import ModelShape, ParallelDims, ShardkitError, StepOptions
from shardkit.cli.main import main
from shardkit.parallelize import parallelize, parallelize_stage
from shardkit.parallelize.fake_world import RankMemory, count_parallel_model, count_rank, fake_world_memory
from shardkit.plan.memory import memory_per_rank
from shardkit.plan.options import resolve_options

ROWS = ("params", "grads", "optimizer")


def _check(rows: list[dict], rel: float) -> None:
    for r in rows:
        for k in ROWS:
            assert r["counted"][k] == pytest.approx(r["planned"][k], rel=rel), (r["stage"], k)


def test_llama_405b_widths_on_256_ranks_equal_the_plan():
    # Llama 3 405B's widths, 10 layers (stages of 3, 3, 2, 2), tp 4 x pp 4 x dp_shard 16
    config = transformers.LlamaConfig(
        hidden_size=16384,
        num_hidden_layers=10,
        num_attention_heads=128,
        num_key_value_heads=8,
        intermediate_size=53248,
        vocab_size=128256,
    )
    rows = fake_world_memory(config, ParallelDims(tp=4, pp=4, dp_shard=16), StepOptions())
    assert [r["rank"] for r in rows] == [0, 64, 128, 192]
    _check(rows, rel=1e-9)
    # the first stage's peak holds its whole tp-local embedding (FSDP2's root is not resharded)
    embedding = 128256 // 4 * 16384 * 2
    assert rows[0]["counted"]["params"] - rows[1]["counted"]["params"] >= embedding


@pytest.mark.parametrize(
    "config, dims",
    [
        (
            transformers.Qwen3MoeConfig(
                hidden_size=2048,
                num_hidden_layers=8,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                intermediate_size=6144,
                moe_intermediate_size=768,
                num_experts=64,
                num_experts_per_tok=8,
                vocab_size=151936,
            ),
            ParallelDims(tp=2, pp=4, dp_shard=32, ep=8),
        ),
        (
            # DeepSeek-V3's widths (MLA, shared experts, dense first layer), 6 layers, 32 experts
            transformers.DeepseekV3Config(num_hidden_layers=6, first_k_dense_replace=1, n_routed_experts=32),
            ParallelDims(pp=2, dp_shard=128, ep=16),
        ),
    ],
    ids=["qwen3_moe-tp2-pp4-dp_shard32-ep8", "deepseek_v3-pp2-dp_shard128-ep16"],
)
def test_moe_with_expert_parallelism_on_256_ranks_equals_the_plan(config, dims):
    rows = fake_world_memory(config, dims, StepOptions())
    assert dims.product == 256 and len(rows) == dims.pp
    _check(rows, rel=1e-3)


SMALL_LLAMA = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, intermediate_size=4096)


@pytest.mark.parametrize(
    "config, dims",
    [
        # HSDP with ring cp inside FSDP2's group, tp and pp
        (
            transformers.LlamaConfig(num_hidden_layers=6, vocab_size=32000, **SMALL_LLAMA),
            ParallelDims(dp_replicate=2, dp_shard=4, cp_ring=2, tp=2, pp=2),
        ),
        # tp 8 over 4 key/value heads: replicated heads, kept out of FSDP2
        (
            transformers.LlamaConfig(num_hidden_layers=6, vocab_size=32000, **SMALL_LLAMA),
            ParallelDims(dp_shard=8, tp=8, pp=2),
        ),
        # replicas without FSDP2: nothing gathered
        (
            transformers.LlamaConfig(num_hidden_layers=6, vocab_size=32000, **SMALL_LLAMA),
            ParallelDims(dp_replicate=4, tp=2, pp=3),
        ),
        # Qwen2's q/k/v biases and tied embeddings (a copy on each end stage)
        (
            transformers.Qwen2Config(
                hidden_size=896,
                num_hidden_layers=4,
                num_attention_heads=14,
                num_key_value_heads=2,
                intermediate_size=4864,
                vocab_size=151936,
                tie_word_embeddings=True,
            ),
            ParallelDims(dp_shard=4, tp=2, pp=2),
        ),
    ],
    ids=["hsdp-cp-tp-pp", "tp-over-kv-heads", "dp_replicate", "qwen2-tied"],
)
def test_layouts_the_planner_keeps_apart_equal_the_plan(config, dims):
    _check(fake_world_memory(config, dims, StepOptions(global_batch=64)), rel=1e-9)


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("layout", [dict(pp=2, dp_shard=2), dict(tp=2, dp_shard=2)], ids=["pp-dp_shard", "tp-dp_shard"])
def test_a_real_gloo_world_counts_what_the_plan_says(layout):
    # the same count on real tensors and gloo (what the fake world stands in for), every rank
    dims = ParallelDims(**layout)
    mesh = dims.build_mesh("cpu")
    model = tiny_decoder(layers=4)  # float64, the trainer's build; 2 layers per stage
    shape = ModelShape.from_config(model.config)
    opts = resolve_options(shape, dims, StepOptions(dtype="float64", global_batch=4))
    kw = dict(sequence_parallel=bool(opts.sequence_parallel), grad_reduce="sum")
    pm = parallelize_stage(model, mesh, loss_sum, **kw) if dims.pp > 1 else parallelize(model, mesh, **kw)
    stage = mesh.local_rank("pp")
    counted = RankMemory(0, stage, *count_parallel_model(pm), elem=8).rows()
    planned = memory_per_rank(shape, dims, opts, stage)
    assert all_true(all(counted[k] == pytest.approx(planned[k], rel=1e-9) for k in ROWS))


@pytest.mark.world(4, timeout=180)
def test_a_real_gloo_world_counts_experts_sharded_over_edp_as_the_plan_says():
    # dp_shard=4, ep=2: each expert on the 2 ranks of its edp group, FSDP2-sharded over them
    dims = ParallelDims(dp_shard=4, ep=2)
    mesh = dims.build_mesh("cpu")
    model = tiny_decoder(model="moe", experts=4, layers=2)
    shape = ModelShape.from_config(model.config)
    opts = resolve_options(shape, dims, StepOptions(dtype="float64", global_batch=4))
    pm = parallelize(model, mesh, sequence_parallel=bool(opts.sequence_parallel), grad_reduce="sum")
    counted = RankMemory(0, 0, *count_parallel_model(pm), elem=8).rows()
    planned = memory_per_rank(shape, dims, opts, 0)
    experts = [p for name, p in pm.module.named_parameters() if pm.layouts[name].expert]
    # each rank holds half of its ep block of experts (2 of the 4): one expert
    assert mesh.size("edp") == 2 and all(p.to_local().shape[0] == 1 and p.shape[0] == 2 for p in experts)
    assert all_true(all(counted[k] == pytest.approx(planned[k], rel=1e-9) for k in ROWS)), (counted, planned)


def test_refusals_name_the_cause():
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256
    )
    with pytest.raises(ShardkitError, match="pp_tp"):
        count_rank(config, ParallelDims(pp_tp=(2, 1)), 0, StepOptions())
    with pytest.raises(ShardkitError, match=r"rank must be in \[0, 4\)"):
        count_rank(config, ParallelDims(tp=2, pp=2), 4, StepOptions())
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with pytest.raises(ShardkitError, match="already initialized"):
            count_rank(config, ParallelDims(tp=2), 0, StepOptions())
    finally:
        dist.destroy_process_group()


def test_plan_dry_run_prints_counted_against_planned(tmp_path, capsys):
    config = tmp_path / "config.json"
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    config.write_text(json.dumps(dict(model_type="llama", vocab_size=256, num_key_value_heads=2, **sizes)))
    args = ["plan", "--config", str(config), "--gpus", "16", "--global-batch", "16"]
    assert main([*args, "--dry-run", "tp=2,pp=2,dp_shard=4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("pp=2 x dp_shard=4 x tp=2 (16 ranks), bfloat16")
    stages = [line.split(" | ") for line in out[2:]]
    assert [s[:2] for s in stages] == [["0", "0"], ["1", "8"]] and all(s[-1] == "0.00%" for s in stages)
    assert main([*args, "--dry-run", "tp=3"]) == 2  # 3 does not divide 16 GPUs
    assert "does not divide 16 GPUs" in capsys.readouterr().out
