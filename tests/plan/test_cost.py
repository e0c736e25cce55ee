"""Cost formulas against hand-computed values, parameter accounting against the real models, the
``shardkit plan`` command and its refusals (single process: no world)."""

import json

import pytest

from harness.tiny_lm import TINY_LLAMA_CONFIG as TINY
from shardkit import Cluster, ModelShape, ParallelDims, ShardkitError, StepOptions, estimate_step, plan_layouts
from shardkit.cli.main import main
from shardkit.plan.activations import BlockLayout, block_saved_bytes
from shardkit.plan.cluster import CLUSTERS
from shardkit.plan.collectives import CommRow
from shardkit.plan.memory import memory_per_rank
from shardkit.plan.timing import bus_factor, row_seconds, tree_all_reduce_seconds


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == (1.5, 6)  # 2(R-1)/R, 2(R-1) ring steps
    assert bus_factor("all_gather_single", 4) == (0.75, 3)
    assert bus_factor("all_to_all_single", 8) == (7 / 8, 7)
    assert bus_factor("send", 2) == (1.0, 1)


def test_alpha_beta_seconds_by_hand():
    cluster = Cluster(
        gpus=16, gpus_per_node=8, intra_gbps=100.0, inter_gbps=10.0, intra_latency_us=2.0, inter_latency_us=20.0
    )
    dims = ParallelDims(dp_replicate=4, tp=4)
    tp_row = CommRow("tp", "all_reduce", "all_reduce_forward", "forward", 4, 3, 3 * 10**8, 3 * 10**8)
    # inside a node: 3 calls x 6 steps x 2 us + 3e8 B x 1.5 / 1e11 B/s
    assert row_seconds(tp_row, dims, cluster) == pytest.approx(3 * 6 * 2e-6 + 3e8 * 1.5 / 1e11, rel=1e-12)
    dp_row = CommRow("dp", "all_reduce", "dp_cp_grads", "backward", 4, 1, 10**9, 10**9)
    # dp ranks are 4 apart: the group spans 16 ranks, two nodes: the NIC's bandwidth and latency
    assert row_seconds(dp_row, dims, cluster) == pytest.approx(6 * 20e-6 + 1e9 * 1.5 / 1e10, rel=1e-12)


def test_all_reduce_across_nodes_takes_the_cheaper_of_ring_and_tree_by_hand():
    cluster = Cluster(
        gpus=32, gpus_per_node=8, intra_gbps=100.0, inter_gbps=10.0, intra_latency_us=2.0, inter_latency_us=20.0
    )
    dims = ParallelDims(dp_replicate=4, tp=8)
    # 8 bytes over the world (4 nodes of 8): ring 62 steps x 20 us; tree: a chain of 7 intra hops
    # and ceil(log2 4) = 2 inter hops, up and down: 2 (7 x 2 + 2 x 20) us, the bytes through the NIC twice
    scalar = CommRow("world", "all_reduce", "grad_norm", "optimizer", 32, 1, 8, 8)
    tree = 2 * (7 * 2e-6 + 2 * 20e-6) + 2 * 8 / 1e10
    assert tree < 62 * 20e-6 + 8 * 2 * 31 / 32 / 1e10
    assert row_seconds(scalar, dims, cluster) == pytest.approx(tree, rel=1e-12)
    assert tree_all_reduce_seconds(1, 8, 32, 32, cluster) == pytest.approx(tree, rel=1e-12)
    # 1 GB over the 4 dp ranks (one per node, 8 apart): the bytes dominate, the ring's 2 (R - 1) / R wins
    big = CommRow("dp", "all_reduce", "dp_cp_grads", "backward", 4, 1, 10**9, 10**9)
    ring = 6 * 20e-6 + 1e9 * 1.5 / 1e10
    assert ring < 2 * 2 * 20e-6 + 2e9 / 1e10
    assert row_seconds(big, dims, cluster) == pytest.approx(ring, rel=1e-12)
    # inside a node the ring alone (NCCL's intra-node tree is a chain: no gain)
    tp_row = CommRow("tp", "all_reduce", "all_reduce_forward", "forward", 8, 1, 8, 8)
    assert row_seconds(tp_row, dims, cluster) == pytest.approx(14 * 2e-6 + 8 * 1.75 / 1e11, rel=1e-12)
    # Llama 3 405B's world, 16,384 H100s: the loss and the gradient norm cost 0.3 ms, not 0.33 s
    h100 = Cluster(gpus=16384, **CLUSTERS["h100"])
    world = ParallelDims(tp=8, pp=16, dp_replicate=128)
    loss = CommRow("world", "all_reduce", "train_loss", "forward", 16384, 1, 16, 16)
    assert row_seconds(loss, world, h100) == pytest.approx(2 * (7 * 3e-6 + 11 * 10e-6) + 32 / 50e9, rel=1e-9)


def test_flops_and_bubble_by_hand():
    shape = ModelShape.from_config(TINY)
    # per layer: q 64x64, k,v 64x32, o 64x64, mlp 3 x 64 x 128; plus lm_head 256 x 64
    active = 4 * (4096 + 2 * 2048 + 4096 + 3 * 8192) + 256 * 64
    assert shape.active_params == active
    assert shape.flops_per_token(16) == 6 * active + 3 * 4 * 16 * 4 * (16 + 16)
    cluster = Cluster(gpus=4, gpus_per_node=4)
    est = estimate_step(
        shape, ParallelDims(pp=4), StepOptions(seq_len=16, global_batch=8, microbatches=8, dtype="float32"), cluster
    )
    assert est.bubble == pytest.approx(3 / 11)  # (p - 1) / (m + p - 1)
    flops = shape.flops_per_token(16) * 8 * 16
    assert est.compute_s == pytest.approx(flops / 4 / (989e12 * 0.5))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "moe", "mla"])
def test_parameters_equal_the_real_model(family):
    from shardkit.train.config import TrainConfig, validate_config
    from shardkit.train.specs import model_spec

    cfg = validate_config(TrainConfig(model=family, nproc=1, tp=1, dtype="float32"))
    model = model_spec(cfg.model).build(cfg)
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
    code = main(
        [
            "plan",
            "--config",
            str(config),
            "--gpus",
            "8",
            "--gpus-per-node",
            "4",
            "--seq-len",
            "64",
            "--global-batch",
            "16",
            "--top",
            "3",
            "--compare",
            "tp=2,pp=2",
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "fastest 3 layouts" in out and "pp=2 x dp_replicate=2 x tp=2" in out
    assert (tmp_path / "p.png").exists() or "pip install" in out


def test_ranking_is_sorted_and_fits():
    cluster = Cluster(gpus=8, gpus_per_node=4)
    best = plan_layouts(TINY, cluster, StepOptions(seq_len=64, global_batch=16), top=5)
    assert [e.step_s for e in best] == sorted(e.step_s for e in best) and all(e.fits for e in best)
    assert all(e.dims.product == 8 for e in best)


@pytest.mark.parametrize(
    "config,match",
    [
        ({**TINY, "hidden_size": None}, "hidden_size"),
        ({**TINY, "model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({**TINY, "num_key_value_heads": 3}, "multiple of num_key_value_heads=3"),
    ],
)
def test_bad_config_is_refused(config, match):
    with pytest.raises(ShardkitError, match=match):
        ModelShape.from_config(config)


def test_bad_layouts_are_refused(tmp_path, capsys):
    shape = ModelShape.from_config(TINY)
    with pytest.raises(ShardkitError, match="uses 4 GPUs, the cluster has 8"):
        estimate_step(shape, ParallelDims(tp=4), StepOptions(seq_len=16, global_batch=8), Cluster(gpus=8))
    with pytest.raises(ShardkitError, match="tp=8: --tp 8: 4 query heads cannot be split over tp=8 ranks"):
        estimate_step(shape, ParallelDims(tp=8), StepOptions(seq_len=16, global_batch=8), Cluster(gpus=8))
    with pytest.raises(ShardkitError, match="no layout fits in 1e-05 GiB"):
        plan_layouts(shape, Cluster(gpus=4, gpu_memory_gib=1e-05), StepOptions(seq_len=16, global_batch=8))
    config = tmp_path / "bad.json"
    config.write_text("{not json")
    assert main(["plan", "--config", str(config), "--gpus", "8"]) == 2
    assert "cannot read the config" in capsys.readouterr().out


def test_gpipe_holds_every_microbatch_and_gathers_each_group_once():
    from shardkit.plan.collectives import merged, step_collectives

    shape = ModelShape.from_config(TINY)
    dims = ParallelDims(pp=2, dp_shard=2)
    one_f_one_b = StepOptions(seq_len=16, global_batch=8, microbatches=4, dtype="float32")
    gpipe = StepOptions(seq_len=16, global_batch=8, microbatches=4, dtype="float32", schedule="gpipe")
    # stage 0 of 2: 1F1B keeps min(M, 2) = 2 microbatches' activations, GPipe all 4
    acts = memory_per_rank(shape, dims, gpipe)["activations"] - memory_per_rank(shape, dims, one_f_one_b)["activations"]
    block = block_saved_bytes(shape, BlockLayout(rows=1, seq_len=16), "none", 4)
    assert acts == 2 * 2 * block  # 2 more microbatches x 2 layers
    key = ("all_gather_single", "fully_shard", "forward", 2)
    # either schedule (set_microbatch): every group (2 layers and the root) gathered once per
    # step, before the first forward, never again for a backward, and reduced once
    for opts in (one_f_one_b, gpipe):
        table = merged(step_collectives(shape, dims, opts, 1))
        assert table[key][0] == 2 + 1
        assert ("all_gather_single", "fully_shard", "backward", 2) not in table
        assert table[("reduce_scatter_single", "fully_shard", "backward", 2)][0] == 2 + 1


def test_pp_tp_stage_roles_and_compute():
    from shardkit.plan.collectives import merged, step_collectives
    from shardkit.plan.options import rank_stage

    shape = ModelShape.from_config(TINY)
    dims = ParallelDims(dp_replicate=2, pp_tp=(2, 1, 1), world_size=8)
    assert [rank_stage(dims, r) for r in range(8)] == [(0, 0), (0, 1), (1, 0), (2, 0)] * 2
    opts = StepOptions(seq_len=16, global_batch=4, microbatches=2, dtype="float32")
    act = 1 * 16 * 64 * 4
    leader, other = (merged(step_collectives(shape, dims, opts, 0, i)) for i in (0, 1))
    assert leader[("send", "p2p", "forward", 4)] == (4, 2 * (act + 160), 0)  # a header and the payload each
    assert leader[("broadcast", "p2p", "backward", 2)] == (2, 2 * act, 0)  # gradients broadcast in the stage
    assert ("send", "p2p", "forward", 4) not in other and other[("broadcast", "p2p", "backward", 2)] == (2, 0, 2 * act)
    est = estimate_step(shape, dims, opts, Cluster(gpus=8, gpus_per_node=8))
    # the slowest stage sets the pace: 4 layers as 2, 1, 1 over tp 2, 1, 1: stages 0 and 1 each do 1/4 per rank
    flops = shape.flops_per_token(16) * 4 * 16
    assert est.compute_s == pytest.approx(flops / 4 / 2 / (989e12 * 0.5))


@pytest.mark.parametrize(
    "dims,opts,match",
    [
        (
            ParallelDims(spatial=2, world_size=2),
            StepOptions(seq_len=16, global_batch=2),
            "--spatial 2 needs --model conv-ae",
        ),
        (
            ParallelDims(pp_tp=(2, 1), world_size=3),
            StepOptions(seq_len=16, global_batch=2, sequence_parallel=True),
            "--sequence-parallel with --pp-tp: stages of different tp sizes",
        ),
        (ParallelDims(pp=2), StepOptions(seq_len=16, global_batch=2, schedule="zb"), "schedule must be one of"),
    ],
)
def test_refused_layouts_say_why(dims, opts, match):
    from shardkit.plan import step_collectives

    with pytest.raises(ShardkitError, match=match):
        step_collectives(ModelShape.from_config(TINY), dims, opts)


def test_plan_command_compares_a_pp_tp_layout(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    code = main(
        [
            "plan",
            "--config",
            str(config),
            "--gpus",
            "8",
            "--seq-len",
            "64",
            "--global-batch",
            "16",
            "--top",
            "1",
            "--schedule",
            "gpipe",
            "--compare",
            "pp_tp=2:1:1",
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "pp_tp=2,1,1" in out and "refused" not in out


@pytest.mark.parametrize(
    "overrides",
    [
        dict(model="llama", tp=2),
        dict(model="llama", tp=1),
        dict(model="moe", tp=2),
        dict(model="mla", tp=2, ep=2),
        dict(model="llama", pp_tp="2,1,1", layers=3),
    ],
)
def test_sequence_parallel_default_is_the_trainers(overrides):
    from shardkit.plan.options import resolve_options
    from shardkit.train.config import TrainConfig, parallel_dims, validate_config
    from shardkit.train.model import hf_config
    from shardkit.train.specs import model_spec

    cfg = validate_config(TrainConfig(**{"nproc": 4, **overrides}), world_size=4)
    shape = ModelShape.from_config(hf_config(cfg, model_spec(cfg.model).family)[1])
    planned = resolve_options(shape, parallel_dims(cfg), StepOptions(seq_len=cfg.seq_len, global_batch=cfg.batch_size))
    assert planned.sequence_parallel == cfg.sequence_parallel
