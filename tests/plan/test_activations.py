"""The planner's activation model (:mod:`shardkit.plan.activations`) against the measured bytes.

Each case parallelizes a small transformers Llama (GQA: 8 query heads, 4 key/value heads) with
the layout and checkpointing mode, runs a forward under
:class:`~shardkit.parallelize.saved_bytes.SavedBytesMeter` and compares block 0's bytes on every
rank with :func:`~shardkit.plan.activations.block_saved_bytes`. The issue asked for 5 %; the
model is exact on every case here, so the test holds it to the byte (a change in transformers or
in shardkit's blocks that keeps more or less shows up as a failure naming the layout and mode).
Ring attention's selective figure is rank 0's (the zigzag ranks differ), so it is compared there
only.
"""

from __future__ import annotations

import dataclasses

import pytest

from harness.helpers import all_true, rank
from harness.tiers import tiered
from harness.tiny_lm import tiny_decoder, token_ids
from shardkit import ShardkitError
from shardkit.parallelize import decoder_layers, parallelize
from shardkit.parallelize.saved_bytes import SavedBytesMeter
from shardkit.plan import Cluster, estimate_step
from shardkit.plan.activations import BlockLayout, block_saved_bytes
from shardkit.plan.memory import memory_per_rank
from shardkit.plan.model import ModelShape
from shardkit.plan.options import StepOptions
from shardkit.sharding import ParallelDims

ROWS, S = 2, 16
SIZES = dict(hidden_size=64, intermediate_size=96, heads=8, kv_heads=4, seq_len=S)
SHAPE = ModelShape("llama", vocab=256, hidden=64, layers=2, heads=8, kv_heads=4, head_dim=8, ffn=96)

# name -> (ParallelDims on 4 ranks, sequence parallel, dtype)
LAYOUTS = {
    "tp1": (dict(dp_replicate=4), False, "float64"),
    "tp2+sp": (dict(tp=2, dp_replicate=2), True, "float64"),
    "tp2": (dict(tp=2, dp_replicate=2), False, "float64"),
    "tp4+sp (kv replicated)": (dict(tp=4), True, "float64"),
    "ulysses2": (dict(cp_ulysses=2, dp_replicate=2), False, "float64"),
    "ulysses4": (dict(cp_ulysses=4), False, "float64"),
    "ring2": (dict(cp_ring=2, dp_replicate=2), False, "float64"),
    "tp2+sp x ulysses2": (dict(tp=2, cp_ulysses=2), True, "float64"),
    "tp2+sp x ring2": (dict(tp=2, cp_ring=2), True, "float64"),
    "tp2+sp bf16": (dict(tp=2, dp_replicate=2), True, "bfloat16"),
    "ulysses2 bf16": (dict(cp_ulysses=2, dp_replicate=2), False, "bfloat16"),
    # sequence parallelism keeps the norm's output shard by default (sp_activation="shard");
    # these keep the all-gather's output instead
    "tp2+sp gathered": (dict(tp=2, dp_replicate=2), True, "float64", "gathered"),
    "tp2+sp x ring2 gathered": (dict(tp=2, cp_ring=2), True, "float64", "gathered"),
}
ELEM = {"float64": 8, "bfloat16": 2}

# Quick tier (issue 32, item 4): each branch of block_saved_bytes once. tp2: tensor parallel
# without SP (the gathers kept by selective); tp4+sp: whole kv heads per rank; ulysses2 bf16:
# tp 1, Ulysses' all-to-alls, 2-byte elements with fp32 statistics; tp2+sp x ulysses2: the SP
# shard with Ulysses' expanded kv heads; tp2+sp x ring2 gathered: the gathered SP input and
# ring's selective figure. The other 8 compose the same branches (CI runs them).
QUICK = ("tp2", "tp4+sp (kv replicated)", "ulysses2 bf16", "tp2+sp x ulysses2", "tp2+sp x ring2 gathered")


def _measured(mesh, sp: bool, dtype: str, mode: str, sp_act: str) -> tuple[int, BlockLayout]:
    model = tiny_decoder(**SIZES, dtype=dtype)
    pm = parallelize(model, mesh, sequence_parallel=sp, activation_checkpoint=mode, sp_activation=sp_act)
    ids = token_ids(ROWS * mesh.size("dp"), seq_len=S)[mesh.local_rank("dp") * ROWS :][:ROWS]
    inputs = pm.cp.shard_batch(ids, ids).inputs if pm.cp is not None else dict(input_ids=ids)
    with SavedBytesMeter(decoder_layers(pm.module), mode) as meter:
        pm.module(**inputs).logits.float().pow(2).sum().backward()
    where = BlockLayout(ROWS, S, mesh.size("tp"), mesh.size("cp_ulysses"), mesh.size("cp_ring"), sp, sp_act)
    return meter.per_block[0], where


@pytest.mark.world(4, timeout=180)
@pytest.mark.parametrize("layout", tiered({name: (layout,) for name, layout in LAYOUTS.items()}, QUICK))
def test_the_planner_counts_the_saved_bytes_of_every_mode(layout):
    dims, sp, dtype, sp_act = (*layout, "shard")[:4]
    wrong = []
    mesh = ParallelDims(**dims).build_mesh("cpu")  # one mesh (its process groups) for the three modes
    for mode in ("none", "full", "selective"):
        measured, where = _measured(mesh, sp, dtype, mode, sp_act)
        model = block_saved_bytes(SHAPE, where, mode, ELEM[dtype])
        ring_selective = mode == "selective" and where.cp_ring > 1
        if measured != model and (rank() == 0 or not ring_selective):
            wrong.append(f"{mode}: measured {measured}, planner {model}")
    assert all_true(not wrong), wrong


def test_checkpointing_lowers_the_planned_activation_memory():
    # 32 layers at tp 1 (where selective keeps less than none; the recompute adds one block's worth)
    deep, dims = dataclasses.replace(SHAPE, layers=32), ParallelDims()
    acts = {
        mode: memory_per_rank(deep, dims, StepOptions(seq_len=S, global_batch=4, activation_checkpoint=mode))[
            "activations"
        ]
        for mode in ("none", "selective", "full")
    }
    assert acts["full"] < acts["selective"] < acts["none"]
    with pytest.raises(ShardkitError, match="activation checkpointing must be one of"):
        memory_per_rank(deep, dims, StepOptions(seq_len=S, global_batch=4, activation_checkpoint="some"))


def test_checkpointing_charges_its_recompute_in_the_step_time():
    deep = dataclasses.replace(SHAPE, layers=32)
    cluster = Cluster(gpus=1, gpus_per_node=1)
    est = {
        mode: estimate_step(
            deep, ParallelDims(), StepOptions(seq_len=S, global_batch=4, activation_checkpoint=mode), cluster
        )
        for mode in ("none", "selective", "full")
    }
    assert est["full"].compute_s == pytest.approx(est["none"].compute_s * 4 / 3)  # one more forward
    assert est["none"].compute_s < est["selective"].compute_s < est["full"].compute_s
    assert est["full"].mfu < est["none"].mfu  # model FLOPs leave the recompute out
