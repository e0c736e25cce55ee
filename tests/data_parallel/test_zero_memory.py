"""ZeRO's memory, counted: AdamW state for ``1 / R`` of each bucket, as the planner says.

* Measured (a real 4-rank gloo world, float32, after one :func:`~shardkit.train.trainer.train_step`):
  every rank's AdamW moments (``exp_avg`` and ``exp_avg_sq``, bytes of the tensors it holds) equal
  :func:`shardkit.plan.memory.memory_per_rank`'s optimizer row for its stage, and are ``1 / R`` of
  the same run without ZeRO (up to the bucket's padding). Parameters stay whole.
* Fake world (:mod:`shardkit.parallelize.fake_world`, hundreds of ranks, the model on the meta
  device): the counted optimizer row of each pipeline stage equals the planned one to the byte,
  for Llama 3 405B's widths at tp 8 x pp 4 x dp_replicate 8 with ZeRO-1.
"""

import pytest
import torch
import torch.distributed as dist
import transformers

from harness.helpers import SMALL_CORPUS, rank, world_size
from harness.tiers import tiered
from shardkit import ParallelDims, ShardkitError, StepOptions
from shardkit.parallelize.fake_world import fake_world_memory
from shardkit.plan import ModelShape
from shardkit.plan.memory import memory_per_rank
from shardkit.plan.options import rank_stage
from shardkit.train.config import TrainConfig, parallel_dims, validate_config
from shardkit.train.model import hf_config
from shardkit.train.run import build_parallel_model, build_task, build_train_model
from shardkit.train.specs import model_spec
from shardkit.train.trainer import LossScale, make_optimizer, train_step

CORPUS = SMALL_CORPUS
SMALL = dict(steps=1, seq_len=16, batch_size=4, dtype="float32", layers=2, lr=1e-3, data=CORPUS)


def _state_bytes(optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for st in optimizer.state.values()
        for key, t in st.items()
        if key in ("exp_avg", "exp_avg_sq")
    )


def _measured(cfg: TrainConfig, mesh) -> tuple[int, int]:
    """(AdamW moment bytes, parameter bytes) of this rank after one step of ``cfg`` on ``mesh``."""
    device = torch.device("cpu")
    task = build_task(cfg, device)
    pm, loss_scale = build_parallel_model(build_train_model(cfg), mesh, cfg, task, device)
    optimizer = make_optimizer(pm.module, cfg.lr, pm.grads)
    train_step(pm, optimizer, task, microbatches=cfg.microbatches, loss_scale=loss_scale or LossScale(task))
    params = sum(p.numel() * p.element_size() for p in pm.module.parameters())
    return _state_bytes(optimizer), params


# Quick tier (issue 32, item 4): dp4-zero1 shards the moments as dp4-zero2-padded does (the
# stages differ in the gradients, not in the optimizer state) and ZeRO-1 is pp2-dp2-zero1's;
# CI runs it.
MEMORY = {
    "dp4-zero1": dict(tp=1, zero=1),
    "tp2-dp2-zero2": dict(tp=2, zero=2),
    "pp2-dp2-zero1": dict(tp=1, pp=2, microbatches=2, zero=1),
    "dp4-zero2-padded": dict(tp=1, zero=2, hidden_size=18, heads=3, kv_heads=1),  # 24858 elements in 4 slices of 6215
    "moe-ep2-dp2-zero2": dict(model="moe", ep=2, zero=2),
}


@pytest.mark.world(4, timeout=120)
@pytest.mark.parametrize("overrides", tiered(MEMORY, [k for k in MEMORY if k != "dp4-zero1"]))
def test_measured_optimizer_state_equals_the_plan(overrides):
    cfg = validate_config(TrainConfig(**{**SMALL, **overrides}), world_size=world_size())
    dims = parallel_dims(cfg)
    mesh = dims.build_mesh("cpu")  # one mesh (its process groups) for both runs: the same layout
    zero_state, zero_params = _measured(cfg, mesh)
    plain = validate_config(TrainConfig(**{**SMALL, **overrides, "zero": 0}))
    assert parallel_dims(plain) == dims
    plain_state, plain_params = _measured(plain, mesh)
    shape = ModelShape.from_config(hf_config(cfg, model_spec(cfg.model).family)[1])
    opts = StepOptions(16, 4, cfg.microbatches, "float32", cfg.sequence_parallel, zero=cfg.zero)
    stage, _ = rank_stage(dims, rank())
    planned = memory_per_rank(shape, dims, opts, stage)
    assert zero_state == planned["optimizer"], (zero_state, planned["optimizer"])
    assert zero_params == plain_params == planned["params"]
    R = dims.dp * dims.cp  # every case's buckets are over R = 2 or 4 ranks (edp = dp here)
    assert plain_state // R <= zero_state < plain_state // R + 8 * R
    dist.barrier()


def test_fake_world_llama_405b_widths_zero1_equals_the_plan():
    config = transformers.LlamaConfig(
        hidden_size=16384,
        num_hidden_layers=8,
        num_attention_heads=128,
        num_key_value_heads=8,
        intermediate_size=53248,
        vocab_size=128256,
    )
    dims = ParallelDims(tp=8, pp=4, dp_replicate=8)
    rows = fake_world_memory(config, dims, StepOptions(zero=1))
    plain = fake_world_memory(config, dims, StepOptions())
    for r, p in zip(rows, plain):
        assert r["counted"] == r["planned"], r
        assert r["counted"]["optimizer"] == pytest.approx(p["counted"]["optimizer"] / 8, rel=1e-6)


def test_zero_over_fsdp2_is_refused_by_the_planner():
    with pytest.raises(ShardkitError, match="zero 1 with dp_shard 4: FSDP2 already shards"):
        fake_world_memory(transformers.LlamaConfig(num_hidden_layers=2), ParallelDims(dp_shard=4), StepOptions(zero=1))


def test_fake_world_deepseek_v3_ep_over_zero1_replicas_equals_the_plan():
    # DeepSeek-V3's widths (6 layers, 32 experts): ep 16 over ZeRO-1 replicas, pp 2, 256 ranks;
    # the dense bucket over 128 replicas, the experts' over edp = 8
    config = transformers.DeepseekV3Config(num_hidden_layers=6, first_k_dense_replace=1, n_routed_experts=32)
    rows = fake_world_memory(config, ParallelDims(pp=2, dp_replicate=128, ep=16), StepOptions(zero=1))
    assert len(rows) == 2
    for r in rows:
        assert r["counted"] == r["planned"], r
