"""Cost formulas against hand-computed values, parameter accounting against the real models, the
``shardkit plan`` command and its refusals (single process: no world)."""

import json

import pytest

from shardkit import Cluster, ModelShape, ParallelDims, ShardkitError, StepOptions, estimate_step, plan_layouts
from shardkit.cli.main import main
from shardkit.plan.collectives import CommRow
from shardkit.plan.memory import memory_per_rank
from shardkit.plan.timing import bus_factor, row_seconds

TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == (1.5, 6)  # 2(R-1)/R, 2(R-1) ring steps
    assert bus_factor("all_gather_single", 4) == (0.75, 3)
    assert bus_factor("all_to_all_single", 8) == (7 / 8, 7)
    assert bus_factor("send", 2) == (1.0, 1)


def test_alpha_beta_seconds_by_hand():
    cluster = Cluster(gpus=16, gpus_per_node=8, intra_gbps=100.0, inter_gbps=10.0, intra_latency_us=2.0,
                      inter_latency_us=20.0)
    dims = ParallelDims(dp_replicate=4, tp=4)
    tp_row = CommRow("tp", "all_reduce", "all_reduce_forward", "forward", 4, 3, 3 * 10**8, 3 * 10**8)
    # inside a node: 3 calls x 6 steps x 2 us + 3e8 B x 1.5 / 1e11 B/s
    assert row_seconds(tp_row, dims, cluster) == pytest.approx(3 * 6 * 2e-6 + 3e8 * 1.5 / 1e11, rel=1e-12)
    dp_row = CommRow("dp", "all_reduce", "dp_cp_grads", "backward", 4, 1, 10**9, 10**9)
    # dp ranks are 4 apart: the group spans 16 ranks, two nodes: the NIC's bandwidth and latency
    assert row_seconds(dp_row, dims, cluster) == pytest.approx(6 * 20e-6 + 1e9 * 1.5 / 1e10, rel=1e-12)


def test_flops_and_bubble_by_hand():
    shape = ModelShape.from_config(TINY)
    # per layer: q 64x64, k,v 64x32, o 64x64, mlp 3 x 64 x 128; plus lm_head 256 x 64
    active = 4 * (4096 + 2 * 2048 + 4096 + 3 * 8192) + 256 * 64
    assert shape.active_params == active
    assert shape.flops_per_token(16) == 6 * active + 3 * 4 * 16 * 4 * (16 + 16)
    cluster = Cluster(gpus=4, gpus_per_node=4)
    est = estimate_step(shape, ParallelDims(pp=4), StepOptions(seq_len=16, global_batch=8, microbatches=8,
                                                                dtype="float32"), cluster)
    assert est.bubble == pytest.approx(3 / 11)  # (p - 1) / (m + p - 1)
    flops = shape.flops_per_token(16) * 8 * 16
    assert est.compute_s == pytest.approx(flops / 4 / (989e12 * 0.5))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "moe", "mla"])
def test_parameters_equal_the_real_model(family):
    from shardkit.cli.config import TrainConfig, validate_config
    from shardkit.cli.model import build_model

    model = build_model(validate_config(TrainConfig(model=family, nproc=1, tp=1, dtype="float32")))
    shape = ModelShape.from_config(model.config)
    numel = sum(p.numel() for p in model.parameters())
    assert shape.total_params == numel
    mem = memory_per_rank(shape, ParallelDims(), StepOptions(seq_len=16, global_batch=1, dtype="float32"))
    assert mem["params"] == 4 * numel and mem["grads"] == 4 * numel and mem["optimizer"] == 8 * numel


def test_fsdp_shards_parameters_and_state():
    shape = ModelShape.from_config(TINY)
    opts = StepOptions(seq_len=16, global_batch=4, dtype="float32")
    full = memory_per_rank(shape, ParallelDims(), opts)
    sharded = memory_per_rank(shape, ParallelDims(dp_shard=4), opts)
    assert sharded["optimizer"] == pytest.approx(full["optimizer"] / 4)  # nothing kept back without tp
    assert sharded["grads"] == pytest.approx(full["grads"] / 4)


def test_plan_command_on_a_small_cluster(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    code = main(["plan", "--config", str(config), "--gpus", "8", "--gpus-per-node", "4", "--seq-len", "64",
                 "--global-batch", "16", "--top", "3", "--compare", "tp=2,pp=2", "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert code == 0
    assert "fastest 3 layouts" in out and "pp=2 x dp_replicate=2 x tp=2" in out
    assert (tmp_path / "p.png").exists() or "pip install" in out


def test_ranking_is_sorted_and_fits():
    cluster = Cluster(gpus=8, gpus_per_node=4)
    best = plan_layouts(TINY, cluster, StepOptions(seq_len=64, global_batch=16), top=5)
    assert [e.step_s for e in best] == sorted(e.step_s for e in best) and all(e.fits for e in best)
    assert all(e.dims.product == 8 for e in best)


@pytest.mark.parametrize("config,match", [
    ({**TINY, "hidden_size": None}, "hidden_size"),
    ({**TINY, "model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({**TINY, "num_key_value_heads": 3}, "multiple of num_key_value_heads=3"),
])
def test_bad_config_is_refused(config, match):
    with pytest.raises(ShardkitError, match=match):
        ModelShape.from_config(config)


def test_bad_layouts_are_refused(tmp_path, capsys):
    shape = ModelShape.from_config(TINY)
    with pytest.raises(ShardkitError, match="uses 4 GPUs, the cluster has 8"):
        estimate_step(shape, ParallelDims(tp=4), StepOptions(seq_len=16, global_batch=8), Cluster(gpus=8))
    with pytest.raises(ShardkitError, match="tp=8 must divide num_attention_heads=4"):
        estimate_step(shape, ParallelDims(tp=8), StepOptions(seq_len=16, global_batch=8), Cluster(gpus=8))
    with pytest.raises(ShardkitError, match="no layout fits in 1e-05 GiB"):
        plan_layouts(shape, Cluster(gpus=4, gpu_memory_gib=1e-05), StepOptions(seq_len=16, global_batch=8))
    config = tmp_path / "bad.json"
    config.write_text("{not json")
    assert main(["plan", "--config", str(config), "--gpus", "8"]) == 2
    assert "cannot read the config" in capsys.readouterr().out
