"""``sp_activation="shard"`` (Megatron-style sequence-parallel activations) against ``"gathered"``
and one process: the same gradients, one more all-gather per projection group in backward, and
the bytes it saves.

Each case parallelizes the tiny float64 Llama with sequence parallelism, once per layout of the
norm output, runs one forward and backward of the trainer's loss and compares every full
parameter gradient (gathered over tp) between the two layouts (bitwise: the gather is data
movement and the weight gradient uses ``F.linear``'s own matmuls) and with the one-process
gradient (1e-9). The ledger shows where the shard is gathered again: ``api="sp_regather"``,
phase ``recompute``, once per projection group (attention, MLP, the head) without activation
checkpointing; with it the checkpoint's recompute gathers anyway and the readers take that
gather (the regather runs for the head only, which is not checkpointed).
"""

from __future__ import annotations

import pytest
import torch

from harness.helpers import all_true, rank
from harness.tiny_lm import loss_sum, predicted_tokens, tiny_decoder, token_ids
from shardkit import CommLedger, ShardkitError
from shardkit.parallelize import decoder_layers, gather_full_parameters, parallelize
from shardkit.parallelize.saved_bytes import SavedBytesMeter
from shardkit.plan.activations import BlockLayout, block_saved_bytes
from shardkit.plan.model import ModelShape
from shardkit.sharding import ParallelDims

BATCH, LAYERS = 2, 2
SIZES8 = dict(hidden_size=64, intermediate_size=96, heads=8, kv_heads=4, seq_len=16)
SHAPE8 = ModelShape("llama", vocab=256, hidden=64, layers=2, heads=8, kv_heads=4, head_dim=8, ffn=96)


def _grads(dims: dict, sp_activation: str, ac: str, model: str = "llama", **sizes) -> tuple[dict | None, CommLedger]:
    mesh = ParallelDims(**dims).build_mesh("cpu")
    pm = parallelize(
        tiny_decoder(model, **sizes),
        mesh,
        sequence_parallel=True,
        grad_reduce="sum",
        activation_checkpoint=ac,
        sp_activation=sp_activation,
    )
    ids = token_ids(BATCH, seq_len=sizes.get("seq_len", 8))
    rows = BATCH // mesh.size("dp")
    mine = ids[mesh.local_rank("dp") * rows :][:rows]
    with CommLedger() as ledger:
        loss = loss_sum(pm.module(input_ids=mine).logits, mine) / predicted_tokens(ids)
        loss.backward()
    pm.grads.reduce()
    for p in pm.module.parameters():  # gather_full_parameters gathers values: put the gradients there
        p.data = p.grad
    return gather_full_parameters(pm), ledger


def _reference(name: str) -> dict:
    model = tiny_decoder(name)
    ids = token_ids(BATCH)
    (loss_sum(model(input_ids=ids).logits, ids) / predicted_tokens(ids)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)


@pytest.mark.world(4, timeout=240)
@pytest.mark.parametrize("model,ac", [("llama", "none"), ("llama", "full"), ("llama", "selective"), ("qwen2", "none")])
def test_shard_and_gathered_give_the_same_gradients_and_the_ledger_shows_the_regather(model, ac):
    # qwen2: q/k/v with biases (their gradient is the shard reader's too)
    dims = dict(tp=2, dp_replicate=2)
    shard, ledger = _grads(dims, "shard", ac, model)
    gathered, ledger_g = _grads(dims, "gathered", ac, model)
    problems = []
    if rank() == 0:
        worst = _worst(shard, gathered)
        if worst != 0:  # bitwise: the gather moves data, the weight gradient is F.linear's own matmul
            problems.append(f"shard vs gathered: {worst:.2e}")
        ref = _worst(shard, _reference(model))
        if ref > 1e-9:
            problems.append(f"shard vs one process: {ref:.2e}")
        print(f"{ac}: shard vs gathered {worst:.1e}, shard vs one process {ref:.1e}")
    # one regather per projection group (q/k/v, gate/up) of each layer and the head without AC;
    # with AC the blocks' recompute gathers and its readers reuse it: only the head regathers
    want = 2 * LAYERS + 1 if ac == "none" else 1
    got = ledger.count(api="sp_regather", phase="recompute")
    if got != want or ledger_g.count(api="sp_regather") != 0:
        problems.append(f"sp_regather: {got} (want {want}), gathered {ledger_g.count(api='sp_regather')}")
    # selective: the replay keeps the gathered input (gathered) or the recompute gathers again (shard)
    recomputed = ledger.count(api="all_gather", phase="recompute")
    want_re = {"none": 0, "full": 2 * LAYERS, "selective": 2 * LAYERS}[ac]
    want_re_g = {"none": 0, "full": 2 * LAYERS, "selective": 0}[ac]
    if recomputed != want_re or ledger_g.count(api="all_gather", phase="recompute") != want_re_g:
        problems.append(
            f"recompute all-gathers: shard {recomputed} (want {want_re}), "
            f"gathered {ledger_g.count(api='all_gather', phase='recompute')} (want {want_re_g})"
        )
    assert all_true(not problems), problems


def _block_bytes(sp_activation: str, ac: str) -> int:
    mesh = ParallelDims(tp=8).build_mesh("cpu")
    pm = parallelize(
        tiny_decoder(**SIZES8),
        mesh,
        sequence_parallel=True,
        activation_checkpoint=ac,
        sp_activation=sp_activation,
    )
    ids = token_ids(BATCH, seq_len=SIZES8["seq_len"])
    with SavedBytesMeter(decoder_layers(pm.module), ac) as meter:
        pm.module(input_ids=ids).logits.pow(2).sum().backward()
    return meter.per_block[0]


@pytest.mark.slow  # the measured figure at tp=8 (4 core-s); the quick tier keeps the 4-rank parity above
@pytest.mark.world(8, timeout=300)
def test_tp8_sequence_parallel_block_keeps_35_percent_less_with_the_shard():
    problems, measured = [], {}
    for ac in ("none", "selective"):
        for layout in ("shard", "gathered"):
            measured[ac, layout] = got = _block_bytes(layout, ac)
            where = BlockLayout(BATCH, SIZES8["seq_len"], tp=8, sequence_parallel=True, sp_activation=layout)
            model = block_saved_bytes(SHAPE8, where, ac, 8)
            if got != model:
                problems.append(f"{ac} {layout}: measured {got}, planner {model}")
        saved = 1 - measured[ac, "shard"] / measured[ac, "gathered"]
        if ac == "none" and saved < 0.35:
            problems.append(f"{ac}: the shard keeps only {saved:.1%} less ({measured})")
        if rank() == 0:
            kept = f"shard {measured[ac, 'shard']} B, gathered {measured[ac, 'gathered']} B"
            print(f"tp 8 x SP, {ac}: {kept}, {saved:.1%} less")
    assert all_true(not problems), problems


@pytest.mark.world(2)
def test_a_bad_sp_activation_is_refused_on_every_rank():
    mesh = ParallelDims(tp=2).build_mesh("cpu")
    with pytest.raises(ShardkitError, match="sp_activation must be 'shard' or 'gathered'"):
        parallelize(tiny_decoder(), mesh, sequence_parallel=True, sp_activation="sharded")
    with pytest.raises(ShardkitError, match="sp_activation='shard' with compile"):
        parallelize(tiny_decoder(), mesh, sequence_parallel=True, sp_activation="shard", compile="aot_eager")
    assert torch.distributed.get_world_size() == 2
