"""``parallelize(..., compile=...)``: each decoder block compiled, the same loss and gradients as eager.

On each 2-rank layout (tp with sequence parallelism, Ulysses and ring cp, ep over tp) every rank
builds the tiny float64 decoder twice from the same seed, parallelizes one eagerly and one with
``compile="aot_eager"`` (Dynamo + AOTAutograd, no code generation: fast enough for the suite),
runs two forward and backward passes on the same batch (the second on the cached graphs), and
compares the losses, every local gradient (to 1e-12; measured: bitwise) and the second pass's
communication ledger (equal). With full activation checkpointing the checkpoint wraps the
compiled forward (its recompute runs the compiled graphs); selective is refused. The test can
fail: the compiled blocks must really run (Dynamo's graph counter moves) and the same compiled
model with one weight scaled by 1 + 1e-6 in place is caught (on its cached graphs: milliseconds,
so in every case). The quick tier (``-m "not slow"``) runs the layouts in ``QUICK``.

Dynamo's tracing is the cost (5-9 core-s per rank and layout, measured; the eager steps take
0.1): one layout's blocks are traced once whatever the number of layers (the graphs are shared
by every block), so each test traces each layout once.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from harness.helpers import all_true
from harness.tiers import tiered
from harness.tiny_lm import loss_sum, tiny_decoder, token_ids
from shardkit.comm.ledger import CommLedger
from shardkit.errors import ShardkitError
from shardkit.parallelize import decoder_layers, parallelize
from shardkit.parallelize.compiling import check_compile, graph_breaks
from shardkit.sharding import ParallelDims

BATCH = 2
TOL = 1e-12
TP_SP = (dict(tp=2), {}, True, "none")  # the inductor case's layout
LAYOUTS = {
    "cp_ulysses=2": (dict(cp_ulysses=2), {}, False, "none"),
    "cp_ring=2": (dict(cp_ring=2), {}, False, "none"),
    "moe tp=2 x ep=2, sequence parallel": (dict(tp=2, ep=2), dict(model="moe", experts=4), True, "none"),
    "tp=2, sequence parallel, full AC": (dict(tp=2), {}, True, "full"),
}


def _build(layout: dict, model: dict, sp: bool, ac: str, compile: bool | str):
    """The parallelized tiny decoder and its inputs on this rank."""
    mesh = ParallelDims(**layout).build_mesh("cpu")
    # compiled blocks keep the gathered SP input (parallelize's default with compile): eager alike
    pm = parallelize(
        tiny_decoder(**model),
        mesh,
        sequence_parallel=sp,
        activation_checkpoint=ac,
        compile=compile,
        sp_activation="gathered",
    )
    ids = token_ids(BATCH)
    inputs = pm.cp.shard_batch(ids, ids).inputs if pm.cp is not None else dict(input_ids=ids)
    return pm, inputs


def _passes(pm, inputs):
    """Losses, accumulated local gradients and the second pass's ledger of two forward/backward
    passes (the second runs the cached compiled graphs)."""
    losses = []
    for _ in range(2):
        with CommLedger() as ledger:
            loss = pm.module(**inputs).logits.pow(2).sum()
            loss.backward()
        losses.append(loss.detach())
    grads = {n: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for n, p in pm.module.named_parameters()}
    return torch.stack(losses), grads, [_key(r) for r in ledger.records]


def _step(layout: dict, model: dict, sp: bool, ac: str, compile: bool | str):
    return _passes(*_build(layout, model, sp, ac, compile))


def _key(r) -> tuple:
    return (r.op, r.api, r.phase, r.group_size, r.bytes_sent, r.bytes_received)  # each run has its own groups


def _close(a, b) -> bool:
    loss_a, grads_a = a[:2]
    loss_b, grads_b = b[:2]
    return bool((loss_a - loss_b).abs().max() <= TOL * max(1.0, loss_a.abs().max().item())) and all(
        (grads_a[n] - grads_b[n]).abs().max() <= TOL * max(1.0, grads_a[n].abs().max().item()) for n in grads_a
    )


# Quick tier: tp + SP under full AC, the one compiled case there: compiled blocks between tp's
# collectives, and the checkpoint replaying the compiled graphs (plain tp + SP, the same compiled
# graphs without the replay, is no case of its own; test_inductor_blocks_match_eager compiles it
# in the slow tier). Ring cp's compiled parity is the slow tier's, and so is
# test_graph_breaks_are_counted, which traces its blocks (point-to-point exchanges inside
# attention) through Dynamo (13 core-s for one count).
QUICK = ("tp=2, sequence parallel, full AC",)


@pytest.mark.world(2, timeout=600)
@pytest.mark.parametrize("layout,model,sp,ac", tiered(LAYOUTS, QUICK))
def test_compiled_blocks_match_eager(layout, model, sp, ac):
    torch._dynamo.reset()
    eager = _step(layout, model, sp, ac, False)
    frames = counters["stats"]["unique_graphs"]
    pm, inputs = _build(layout, model, sp, ac, "aot_eager")
    compiled = _passes(pm, inputs)
    assert all_true(counters["stats"]["unique_graphs"] > frames), "no block was compiled"
    assert all_true(_close(eager, compiled)), (eager[0], compiled[0])
    # the ledger still records every collective, also when the cached graphs run
    assert all_true(eager[2] == compiled[2]), (len(eager[2]), len(compiled[2]))
    # The comparison's own sensitivity: the compiled model with one weight of its first block
    # scaled by 1 + 1e-6 in place is caught (its cached graphs take the parameters as inputs; a
    # graph that had frozen the old value would give eager's numbers and fail here too).
    with torch.no_grad():
        next(decoder_layers(pm.module)[0].parameters()).mul_(1 + 1e-6)
    pm.module.zero_grad(set_to_none=True)
    assert all_true(not _close(eager, _passes(pm, inputs)))


@pytest.mark.slow
@pytest.mark.world(2, timeout=600)
def test_inductor_blocks_match_eager():
    # inductor generates and builds C++ for every graph: minutes on this machine, so slow-marked
    layout, model, sp, ac = TP_SP
    torch._dynamo.reset()
    eager = _step(layout, model, sp, ac, False)
    compiled = _step(layout, model, sp, ac, "inductor")
    assert all_true(_close(eager, compiled) and eager[2] == compiled[2]), (eager[0], compiled[0])


@pytest.mark.world(1, timeout=300)
def test_one_process_compiled_matches_eager():
    torch._dynamo.reset()
    ids = token_ids(BATCH)
    runs = []
    for compile in (False, "aot_eager"):
        pm = parallelize(tiny_decoder(), None, compile=compile)
        loss = loss_sum(pm.module(input_ids=ids).logits, ids)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in pm.module.named_parameters()}))
    assert _close(*runs)


@pytest.mark.slow
@pytest.mark.world(2, timeout=600)
def test_graph_breaks_are_counted():
    # on ring cp's block, so that its attention (point-to-point exchanges, a fused block per
    # diagonal and off-diagonal tile) goes through Dynamo; measured: 12 graphs, P2POp
    # construction and the ledger's group reads among the reasons
    torch._dynamo.reset()
    pm, inputs = _build(*LAYOUTS["cp_ring=2"], compile=False)
    found = graph_breaks(pm.module, decoder_layers(pm.module)[0], inputs)
    # shardkit's collectives read their group's size and rank: each read breaks the graph
    assert found.graphs == found.breaks + 1 >= 2 and 0 < sum(found.reasons.values()) <= found.breaks
    assert any("non-Tensor" in r for r in found.reasons), found.reasons


@pytest.mark.world(1, timeout=60)
@pytest.mark.parametrize("value,backend", [(False, None), (True, "inductor"), ("aot_eager", "aot_eager")])
def test_compile_values(value, backend):
    assert check_compile(value) == backend


@pytest.mark.world(1, timeout=60)
def test_unknown_backend_is_refused():
    with pytest.raises(
        ShardkitError, match=r"parallelize\(compile=...\): backend must be one of .*aot_eager.*; got 'fast'"
    ):
        parallelize(tiny_decoder(), None, compile="fast")


@pytest.mark.world(1, timeout=60)
def test_selective_checkpointing_is_refused():
    # SAC's dispatch modes keep Dynamo out of the block: it would silently run eagerly
    with pytest.raises(ShardkitError, match="'aot_eager' with selective activation checkpointing"):
        parallelize(tiny_decoder(), None, activation_checkpoint="selective", compile="aot_eager")
