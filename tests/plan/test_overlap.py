"""The planner's overlap model against time lines drawn by hand: P2P on the critical path only
where the schedule's dependencies put it (:mod:`shardkit.plan.p2p_timeline`), the data-parallel
and FSDP2 collectives as the runtime issues them (:mod:`shardkit.plan.overlap`), and the
transferred messages (the ledger's side) unchanged by the timing."""

import pytest

from harness.tiny_lm import TINY_LLAMA_CONFIG as TINY
from shardkit import Cluster, ModelShape, ParallelDims, ShardkitError, StepOptions, estimate_step
from shardkit.pipeline_parallel.simulate import simulate_steps, transfers
from shardkit.pipeline_parallel.tables import SCHEDULES
from shardkit.plan.collectives import CommRow, step_collectives
from shardkit.plan.overlap import exposed_seconds, fsdp_exposed
from shardkit.plan.p2p_timeline import POSTINGS, p2p_timeline
from shardkit.plan.pipeline import pipeline_cost, step_costs
from shardkit.plan.timing import row_seconds

UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}

# 1F1B, p = 2, m = 4, F = 1, B = 2, one transfer x = 0.5, drawn on paper (rank, step, start, end).
# "need" (NCCL before shapes are trusted: receives posted when the step needs them): a transfer
# starts when its sender finished and the receiver reached the step; the receiver computes after it.
#   rank 0: F0 0-1, F1 1-2, [grad 0 4.5-5] B0 5-7, F2 7-8, [grad 1 8-8.5] B1 8.5-10.5,
#           F3 10.5-11.5, [grad 2 11.5-12] B2 12-14, [grad 3 15-15.5] B3 15.5-17.5
#   rank 1: [act 0 1-1.5] F0 1.5-2.5, B0 2.5-4.5, [act 1 4.5-5] F1 5-6, B1 6-8,
#           [act 2 8-8.5] F2 8.5-9.5, B2 9.5-11.5, [act 3 11.5-12] F3 12-13, B3 13-15
HAND_NCCL = {
    0: [("F", 0, 1), ("F", 1, 2), ("B", 5, 7), ("F", 7, 8), ("B", 8.5, 10.5), ("F", 10.5, 11.5)]
    + [("B", 12, 14), ("B", 15.5, 17.5)],
    1: [("F", 1.5, 2.5), ("B", 2.5, 4.5), ("F", 5, 6), ("B", 6, 8), ("F", 8.5, 9.5), ("B", 9.5, 11.5)]
    + [("F", 12, 13), ("B", 13, 15)],
}
# "taken" (gloo: each neighbour's next receive posted once the previous one was taken) and
# "ahead" (NCCL with trusted shapes: the host runs ahead, every receive is posted before the GPU
# needs it): the same line here. act 1 moves at 2-2.5 while rank 1 runs B0, grad 1 at 7.5-8
# while rank 0 runs F2, act 3 at 11-11.5 during B2: 2.0 of the 8 transfers' 4.0 s show.
HAND_GLOO = {
    0: [("F", 0, 1), ("F", 1, 2), ("B", 5, 7), ("F", 7, 8), ("B", 8, 10), ("F", 10, 11), ("B", 12, 14)]
    + [("B", 15, 17)],
    1: [("F", 1.5, 2.5), ("B", 2.5, 4.5), ("F", 4.5, 5.5), ("B", 5.5, 7.5), ("F", 8.5, 9.5), ("B", 9.5, 11.5)]
    + [("F", 11.5, 12.5), ("B", 12.5, 14.5)],
}


def _hand_makespan(hand):
    for steps in hand.values():  # the drawing itself: each rank's steps in order, no overlap, the right durations
        assert all(end - start == UNIT[k] for k, start, end in steps)
        assert all(a[2] <= b[1] for a, b in zip(steps, steps[1:]))
    return max(end for steps in hand.values() for _, _, end in steps)


@pytest.mark.parametrize(
    "posting, hand, exposed", [("need", HAND_NCCL, 2.5), ("taken", HAND_GLOO, 2.0), ("ahead", HAND_GLOO, 2.0)]
)
def test_1f1b_p2_m4_timeline_equals_the_hand_drawn_one(posting, hand, exposed):
    table = SCHEDULES["1f1b"].build(2, 1, 4)
    line = p2p_timeline(table, placement="looped", v=1, num_microbatches=4, costs=UNIT, x=0.5, posting=posting)
    assert line.makespan == _hand_makespan(hand) == 15.0 + exposed
    assert line.compute == (12.0, 12.0)
    # the planner's predicted pipeline time is the same line, in seconds (f = 0.1 s, x = 0.05 s)
    cost = pipeline_cost("1f1b", 2, 1, 4, 0.1, 0.05, posting=posting)
    assert cost.makespan == pytest.approx(0.1 * (15.0 + exposed), rel=1e-12)
    assert cost.p2p_s == pytest.approx(0.1 * exposed, rel=1e-9)
    # the former model charged x to every sending step: (m + p - 1)(F + B) with F, B + x = 20
    old = simulate_steps(table, num_microbatches=4, costs=step_costs(1.0, 0.5)).makespan
    assert old == pytest.approx(20.0)


def _tables():
    for name, spec in SCHEDULES.items():
        for p, v, m in [(2, 1, 4), (3, 1, 5), (4, 2, 8), (4, 2, 4), (4, 1, 6), (2, 2, 6)]:
            try:
                yield name, spec, p, v, m, spec.build(p, v, m)
            except Exception:  # sizes the schedule refuses (its own tests cover that)
                continue


@pytest.mark.parametrize("posting", POSTINGS)
def test_timeline_bounds_and_free_transfers_on_every_schedule(posting):
    seen = set()
    for name, spec, p, v, m, table in _tables():
        seen.add(name)
        kw = {"placement": spec.placement, "v": v, "num_microbatches": m}
        free = simulate_steps(table, costs=UNIT, **kw).makespan
        assert p2p_timeline(table, costs=UNIT, x=0.0, posting=posting, **kw).makespan == pytest.approx(free)
        for x in (0.1, 0.5, 2.0):
            line = p2p_timeline(table, costs=UNIT, x=x, posting=posting, **kw)
            charged = simulate_steps(table, costs=step_costs(1.0, x), **kw).makespan
            # never faster than free transfers, never slower than charging every send to its sender
            assert free < line.makespan <= charged + 1e-9, (name, p, v, m, x)
            assert sum(line.compute) == pytest.approx(sum(UNIT[s.kind] for row in table for s in row))
    assert seen == set(SCHEDULES)


def test_earlier_receives_hide_more():
    spec = SCHEDULES["interleaved-1f1b"]
    table = spec.build(4, 2, 8)
    kw = {"placement": spec.placement, "v": 2, "num_microbatches": 8, "costs": UNIT, "x": 0.5}
    need, taken, ahead = (p2p_timeline(table, posting=k, **kw).makespan for k in ("need", "taken", "ahead"))
    assert ahead <= taken < need
    assert pipeline_cost("interleaved-1f1b", 4, 2, 8, 1.0, 0.5).makespan == pytest.approx(ahead)  # the default
    with pytest.raises(ShardkitError, match="posting must be one of"):
        p2p_timeline(table, posting="early", **kw)


def test_the_transferred_messages_are_the_tables():
    for _, spec, _, v, m, table in _tables():
        sent, _ = transfers(table, placement=spec.placement, v=v)
        line = p2p_timeline(table, placement=spec.placement, v=v, num_microbatches=m, costs=UNIT, x=0.3)
        assert line.moved == {k: len(msgs) for k, msgs in sent.items()}


def test_fsdp_prefetch_exposes_the_first_call_and_what_outlasts_a_layer():
    # 4 gathers of 0.4 s, layers of 0.3 s forward: 0.4 + 3 x 0.1; reduce-scatters behind 0.6 s: 0.4
    assert fsdp_exposed(4, 1.6, 0.3) == pytest.approx(0.7)
    assert fsdp_exposed(4, 1.6, 0.6) == pytest.approx(0.4)
    assert fsdp_exposed(0, 0.0, 0.3) == 0.0
    rows = [
        (CommRow("tp", "all_reduce", "all_reduce_forward", "forward", 2, 4, 8, 8), 0.25),
        (CommRow("dp", "all_reduce", "dp_cp_grads", "backward", 2, 1, 8, 8), 0.5),
        (CommRow("pp", "send", "p2p", "forward", 2, 4, 8, 0), 9.0),  # the schedule's, not here
        (CommRow("fsdp", "all_gather_single", "fully_shard", "forward", 2, 4, 8, 16), 1.6),
        (CommRow("fsdp", "reduce_scatter_single", "fully_shard", "backward", 2, 4, 16, 8), 1.6),
    ]
    assert exposed_seconds(rows, 0.3) == pytest.approx(0.25 + 0.5 + 0.7 + 0.4)
    with pytest.raises(ShardkitError, match="no overlap rule"):
        exposed_seconds([(CommRow("spatial", "all_reduce", "x", "forward", 2, 1, 8, 8), 1.0)], 0.3)


@pytest.mark.parametrize(
    "dims", [ParallelDims(dp_replicate=2, tp=2), ParallelDims(dp_shard=2, tp=2), ParallelDims(pp=2, dp_replicate=2)]
)
def test_step_time_is_the_makespan_plus_what_the_runtime_waits_for(dims):
    shape = ModelShape.from_config(TINY)
    cluster = Cluster(gpus=4, gpus_per_node=2)
    opts = StepOptions(seq_len=16, global_batch=8, microbatches=4, dtype="float32")
    est = estimate_step(shape, dims, opts, cluster)
    rows = [r for r, _ in est.rows]  # the ledger's rows of the busiest stage, unchanged by the timing model
    assert any(rows == step_collectives(shape, dims, opts, stage) for stage in range(dims.pp))
    seconds = {r: row_seconds(r, dims, cluster) for r in rows}
    layer_f = est.compute_s / (3 * 4) / (4 / dims.pp)
    waited = 0.0
    for r, s in seconds.items():
        if r.axis == "fsdp":  # the first call, then what outlasts the layer it is prefetched behind
            hide = layer_f * (2 if r.phase == "backward" else 1)
            waited += s / r.count + (r.count - 1) * max(0.0, s / r.count - hide)
        elif not (r.axis == "pp" and r.op in ("send", "recv")):
            waited += s  # synchronous (tp, world) or after the last backward (dp): in full
    assert est.comm_s == pytest.approx(waited, rel=1e-12)
    pipe = pipeline_cost("1f1b", dims.pp, 1, 4, est.compute_s / 12, 0.0).makespan
    assert est.step_s >= pipe + waited - 1e-15
    if dims.pp == 1:
        assert est.step_s == pytest.approx(est.compute_s + waited, rel=1e-12)
