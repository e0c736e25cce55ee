"""Schedule tables with virtual stages and the I/W split, checked by the dataflow simulator.

Every schedule of :data:`SCHEDULES`, every ``p`` in 2..8, its ``v`` values in 1..4 and a few
``m >= p`` (under its divisibility rule): each (microbatch, chunk) runs F once and B once (or I
and W once), no deadlock, the peak in-flight activations and, at unit costs (F = I = W = 1,
B = 2), the makespan its source states. Broken tables must be reported.
"""

import pytest

from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel.schedules import gpipe_schedule, one_f_one_b_schedule
from shardkit.pipeline_parallel.simulate import fifo_mismatches, simulate_steps, transfers
from shardkit.pipeline_parallel.steps import Step, chunk_owner, global_chunk, lift
from shardkit.pipeline_parallel.tables import SCHEDULES, schedule_table


def _v_values(name):
    spec = SCHEDULES[name]
    return [v for v in range(1, 5) if spec.v_min <= v <= (spec.v_max or 4)]


def _m_values(name, p):
    if name == "interleaved-1f1b":
        return [p, 2 * p, 3 * p]
    if name == "dualpipev":
        return [2 * p, 2 * p + 1, 3 * p]
    if name == "interleaved-zb":  # m a multiple of its rounds max(1, m // p)
        return [p, p + 1, 2 * p, 3 * p]
    return [p, p + 1, 2 * p, 2 * p + 3]


def _cases(name, p):
    return [(v, m) for v in _v_values(name) for m in _m_values(name, p)]


# Peak in-flight microbatch-chunks on rank r (see each table function's docstring).
PEAK = {
    "1f1b": lambda p, v, m, r: min(p - r, m),
    "gpipe": lambda p, v, m, r: m,
    "interleaved-1f1b": lambda p, v, m, r: min(2 * (p - r - 1) + (v - 1) * p + 1, v * m),
    "looped-bfs": lambda p, v, m, r: v * m,
    "zb-h1": lambda p, v, m, r: min(p, m),
    "interleaved-zb": lambda p, v, m, r: min((v - 1) * (m // max(1, m // p)) + p, v * m),
    "dualpipev": lambda p, v, m, r: 2 * p + 1,
}

# Makespan at unit costs: compute 3 v m per rank plus the bubble each source states.
MAKESPAN = {
    "1f1b": lambda p, v, m: 3 * (m + p - 1),
    "gpipe": lambda p, v, m: 3 * (m + p - 1),
    "interleaved-1f1b": lambda p, v, m: 3 * (v * m + p - 1),  # bubble (p - 1)(t_f + t_b) of a chunk
    "looped-bfs": lambda p, v, m: 3 * (v * m + p - 1),
    "zb-h1": lambda p, v, m: 3 * m + (p - 1),  # bubble (p - 1)(t_f + t_i - t_w)
    "zbv": lambda p, v, m: 6 * m + (p - 1),  # the least possible; for m >= p + 2
    "interleaved-zb": lambda p, v, m: 3 * v * m + (p - 1),  # ZB-H1's over v chunks; for m >= p
    "dualpipev": lambda p, v, m: 6 * m + (p - 1),
}


def _run(name, p, v, m, table=None):
    spec = SCHEDULES[name]
    table = spec.build(p, v, m) if table is None else table
    return simulate_steps(table, placement=spec.placement, v=v, num_microbatches=m)


@pytest.mark.combinations  # a deadlock is a property of a schedule at a given p and m, not of either alone (ms a case)
@pytest.mark.parametrize("p", range(2, 9))
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_step_once_no_deadlock_peak_and_makespan(name, p):
    spec = SCHEDULES[name]
    for v, m in _cases(name, p):
        table = spec.build(p, v, m)
        assert len(table) == p
        for r, row in enumerate(table):
            kinds: dict = {}
            for s in row:
                kinds.setdefault((s.microbatch, s.chunk), []).append(s.kind)
            assert sorted(kinds) == [(j, c) for j in range(m) for c in range(v)], (name, p, v, m, r)
            ok = (["B", "F"], ["F", "I", "W"]) if spec.split_backward else (["B", "F"],)
            assert all(sorted(k) in ok for k in kinds.values()), (name, p, v, m, r)
        rep = _run(name, p, v, m, table)
        assert rep.error is None, (name, p, v, m, rep.error)
        if name == "zbv":
            assert max(rep.peak) <= 2 * p and (m < 2 * p or rep.peak == (2 * p,) * p)
        else:
            assert rep.peak == tuple(PEAK[name](p, v, m, r) for r in range(p)), (name, p, v, m)
        if name == "zbv" and m < p + 2:  # too few microbatches to fill the cool-down
            assert MAKESPAN[name](p, v, m) <= rep.makespan <= 6 * m + 2 * (p - 1)
        else:
            assert rep.makespan == MAKESPAN[name](p, v, m), (name, p, v, m)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_bubble_ordering_the_papers_state(p):
    m = 2 * p
    bubble = {name: _run(name, p, SCHEDULES[name].v_min, m).bubble for name in SCHEDULES}
    assert bubble["1f1b"] == pytest.approx((p - 1) / (m + p - 1))
    assert bubble["gpipe"] == pytest.approx(bubble["1f1b"])
    assert (
        bubble["interleaved-1f1b"] == pytest.approx((p - 1) / (2 * m + p - 1))
        and bubble["interleaved-1f1b"] < bubble["1f1b"]
    )
    assert bubble["zb-h1"] == pytest.approx((p - 1) / (3 * m + p - 1))  # a third of 1F1B's idle time
    assert bubble["zb-h1"] < bubble["interleaved-1f1b"]
    # V-shapes: rank p - 1 idles p - 1 chunk forwards (half a stage each) at the start, no more
    assert bubble["zbv"] == bubble["dualpipev"] == pytest.approx((p - 1) / (6 * m + p - 1))
    assert bubble["zbv"] < bubble["zb-h1"]
    assert bubble["interleaved-zb"] == pytest.approx(bubble["zbv"])  # at v = 2: ZB-H1's over 2 chunks


def test_zero_bubble_time_is_a_third_of_1f1b():
    p, m = 4, 8
    idle = {n: _run(n, p, 1, m).makespan - 3 * m for n in ("1f1b", "zb-h1")}
    assert idle["zb-h1"] * 3 == idle["1f1b"]


def test_plain_tuples_are_steps():
    table = tuple(tuple(tuple(s) for s in row) for row in schedule_table("zbv", 2, 2, 4))
    assert _run("zbv", 2, 2, 4, table) == _run("zbv", 2, 2, 4)


def test_other_costs_are_used():
    costs = {"F": 1.0, "B": 3.0, "I": 2.0, "W": 1.0}
    rep = simulate_steps(schedule_table("1f1b", 3, 1, 5), num_microbatches=5, costs=costs)
    assert rep.makespan == (5 + 3 - 1) * 4 and rep.error is None


def test_a_swapped_pair_deadlocks():
    good = schedule_table("1f1b", 2, 1, 2)
    assert _run("1f1b", 2, 1, 2, good).error is None
    # rank 0 waits for B(0) before its F(1); rank 1 waits for F(1) before its B(0)
    swapped = ((good[0][0], good[0][2], good[0][1], good[0][3]), (good[1][0], good[1][2], good[1][1], good[1][3]))
    rep = _run("1f1b", 2, 1, 2, swapped)
    assert rep.error is not None and rep.error.startswith("deadlock")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda row: row[1:], "expected F+B or F+I+W"),  # a missing F
        (lambda row: row + row[-1:], "twice"),
        (lambda row: tuple(s for s in row if s.kind != "W"), "expected F+B or F+I+W"),  # missing W
        (lambda row: row + (Step("B", 0, 0),), "expected F+B or F+I+W"),  # B beside I+W
        (lambda row: row + (Step("F", 99, 0),), "outside microbatches"),
        (lambda row: row + (Step("X", 0, 0),), "bad step"),
        (lambda row: row + (Step("F", "0", 0),), "bad step"),
    ],
)
def test_broken_tables_are_reported(mutate, match):
    table = schedule_table("zb-h1", 3, 1, 4)
    broken = (mutate(table[0]), *table[1:])
    rep = _run("zb-h1", 3, 1, 4, broken)
    assert rep.error is not None and match in rep.error


@pytest.mark.parametrize(("first", "then"), [("I", "W"), ("F", "I")])
def test_a_step_before_the_one_it_needs_on_the_same_rank_is_a_dependency_violation(first, then):
    table = schedule_table("zb-h1", 2, 1, 2)
    row = list(table[1])
    a, b = row.index(Step(first, 0)), row.index(Step(then, 0))
    row[a], row[b] = row[b], row[a]
    rep = _run("zb-h1", 2, 1, 2, (table[0], tuple(row)))
    assert rep.error is not None and "dependency violation" in rep.error


def test_a_chunk_on_the_wrong_rank_order_deadlocks():
    # interleaved rank 0 running its chunk-1 forward of microbatch 0 before chunk 0's: chunk 1 (global p)
    # needs chunk p - 1 on rank p - 1, which needs rank 0's chunk 0 first
    table = schedule_table("interleaved-1f1b", 2, 2, 2)
    row = list(table[0])
    a, b = row.index(Step("F", 0, 0)), row.index(Step("F", 0, 1))
    row[a], row[b] = row[b], row[a]
    assert _run("interleaved-1f1b", 2, 2, 2, (tuple(row), table[1])).error.startswith("deadlock")


@pytest.mark.parametrize(
    ("name", "p", "v", "m", "match"),
    [
        ("interleaved-1f1b", 4, 2, 6, "multiple of p=4"),
        ("interleaved-1f1b", 4, 1, 8, "chunks per rank"),
        ("interleaved-1f1b", 4, 2, 2, "must be >= 4"),
        ("zbv", 4, 3, 8, "v (chunks per rank) must be 2, got 3"),
        ("dualpipev", 4, 2, 7, "must be >= 8"),
        ("1f1b", 4, 2, 8, "must be 1, got 2"),
        ("interleaved-1f1b", 4, 1, 8, "must be >= 2, got 1"),
        ("gpipe", 2, 1, 0, "must be >= 1"),
        ("zb-h1", 2.0, 1, 4, "must be an int"),
        ("nope", 2, 1, 4, "unknown pipeline schedule"),
    ],
)
def test_sizes_a_schedule_refuses(name, p, v, m, match):
    with pytest.raises(ShardkitError, match=match.replace("(", r"\(").replace(")", r"\)")):
        schedule_table(name, p, v, m)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_registry_states_the_chunks_each_table_accepts(name):
    spec = SCHEDULES[name]
    for v in range(1, 6):
        if spec.v_min <= v <= (spec.v_max or v):
            assert len(spec.build(4, v, 8)) == 4
        else:
            with pytest.raises(ShardkitError, match="chunks per rank"):
                spec.build(4, v, 8)


def test_one_chunk_tables_lift_to_the_step_tables():
    assert schedule_table("1f1b", 3, 1, 5) == lift(one_f_one_b_schedule(3, 5))
    assert schedule_table("gpipe", 3, 1, 5) == lift(gpipe_schedule(3, 5))


@pytest.mark.parametrize("placement", ["looped", "v"])
def test_placements_round_trip(placement):
    p = 4
    v = 2 if placement == "v" else 3
    chunks = sorted(global_chunk(placement, r, c, p) for r in range(p) for c in range(v))
    assert chunks == list(range(p * v))
    for r in range(p):
        for c in range(v):
            assert chunk_owner(placement, global_chunk(placement, r, c, p), p) == (r, c)
    if placement == "v":
        assert global_chunk("v", 0, 1, p) == 2 * p - 1  # loss and embedding on rank 0
        with pytest.raises(ShardkitError, match="local 0 or 1"):
            global_chunk("v", 0, 2, p)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_message_is_sent_once_and_needed_once(name):
    spec = SCHEDULES[name]
    for p in (2, 3, 4):
        for v, m in _cases(name, p):
            sent, needed = transfers(spec.build(p, v, m), placement=spec.placement, v=v)
            assert {k: sorted(x) for k, x in sent.items()} == {k: sorted(x) for k, x in needed.items()}
            # each boundary between chunks on different ranks carries F and B once per microbatch
            cross = sum(
                spec.placement == "looped" or g != p - 1 for g in range(p * v - 1)
            )  # V: chunks p - 1 and p share rank p - 1
            assert sum(len(x) for x in sent.values()) == 2 * m * cross
            fifo = fifo_mismatches(spec.build(p, v, m), placement=spec.placement, v=v)
            # interleaved-zb's input gradients run the chunks in another order than their forwards
            # (a looped table that needs it too): the runner holds early arrivals
            assert fifo == [] or spec.placement == "v" or name == "interleaved-zb", (name, p, v, m, fifo)


@pytest.mark.parametrize(("name", "p", "m"), [("zbv", 2, 4), ("dualpipev", 3, 6), ("interleaved-zb", 2, 3)])
def test_v_tables_can_need_messages_out_of_the_senders_order(name, p, m):
    placement = SCHEDULES[name].placement
    assert fifo_mismatches(schedule_table(name, p, 2, m), placement=placement, v=2) != []
