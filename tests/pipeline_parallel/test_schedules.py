"""Pipeline schedule tables (pure): structure, memory bound, deadlock freedom in the dataflow
simulator (the one simulator; ``simulate`` is its deprecated one-chunk form), and the simulated
bubble against (P - 1) / (M + P - 1)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel import simulate as old
from shardkit.pipeline_parallel.schedules import (
    Action,
    bubble_fraction,
    gpipe_schedule,
    one_f_one_b_schedule,
    validate_schedule,
)
from shardkit.pipeline_parallel.simulate import simulate_steps
from shardkit.pipeline_parallel.steps import lift


def simulate(table, f_time=1.0, b_time=1.0):
    """The dataflow simulator on a one-chunk table (as the deprecated ``simulate``)."""
    m = len({a.microbatch for a in table[0]})
    return simulate_steps(lift(table), num_microbatches=m, costs={"F": f_time, "B": b_time, "I": 1.0, "W": 1.0})


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}
sizes = dict(P=st.integers(1, 8), M=st.integers(1, 12))
prop = settings(derandomize=True, database=None, deadline=None, max_examples=60)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@prop
@given(**sizes)
def test_every_microbatch_forward_then_backward_once(name, P, M):
    table = SCHEDULES[name](P, M)
    assert len(table) == P
    for acts in table:
        assert sorted(a for a in acts if a.kind == "F") == [Action("F", m) for m in range(M)]
        assert sorted(a for a in acts if a.kind == "B") == [Action("B", m) for m in range(M)]
        for m in range(M):
            assert acts.index(Action("F", m)) < acts.index(Action("B", m))
    assert validate_schedule(table, P) == M


def _in_flight(acts):
    live = peak = 0
    for a in acts:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


@prop
@given(**sizes)
def test_1f1b_warmup_and_memory_bound(P, M):
    for s, acts in enumerate(one_f_one_b_schedule(P, M)):
        w = min(P - s - 1, M)  # warm-up forwards, then F/B alternation, then cool-down backwards
        assert [a.kind for a in acts] == ["F"] * w + ["F", "B"] * (M - w) + ["B"] * w
        assert _in_flight(acts) == min(P - s, M) <= P - s
    assert all(_in_flight(acts) == M for acts in gpipe_schedule(P, M))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("b_time", [1.0, 2.0], ids=["F1B1", "F1B2"])
@prop
@given(**sizes)
def test_simulated_run_finishes_with_the_analytic_bubble(name, b_time, P, M):
    result = simulate(SCHEDULES[name](P, M), f_time=1.0, b_time=b_time)
    assert result.error is None
    assert result.makespan == (1.0 + b_time) * (M + P - 1)
    assert result.bubble == pytest.approx(bubble_fraction(P, M), abs=1e-12)
    assert result.bubble == pytest.approx((P - 1) / (M + P - 1), abs=1e-12)


def test_simulated_peak_activations():
    assert simulate(one_f_one_b_schedule(4, 8)).peak == (4, 3, 2, 1)
    assert simulate(gpipe_schedule(4, 8)).peak == (8, 8, 8, 8)


def test_deprecated_simulate_keeps_its_fields_and_warns():
    with pytest.warns(DeprecationWarning, match="simulate_steps"):
        result = old(one_f_one_b_schedule(4, 8), b_time=2.0)
    assert result.error is None and result.makespan == 3.0 * 11 and result.peak_activations == (4, 3, 2, 1)
    assert result.bubble_fraction == pytest.approx(bubble_fraction(4, 8), abs=1e-12)


def test_1f1b_pairs_steady_state_communication():
    # P = 2, M = 3: stage 0 warms up with one forward; stage 1 alternates from the start.
    table = one_f_one_b_schedule(2, 3)
    assert table == (
        (Action("F", 0), Action("F", 1), Action("B", 0), Action("F", 2), Action("B", 1), Action("B", 2)),
        (Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1), Action("F", 2), Action("B", 2)),
    )


def test_simulator_detects_deadlock_and_runs_messages_out_of_order():
    # Backward order differs between stages: the runner holds the early gradient (its mailbox),
    # so the table runs.
    good = gpipe_schedule(2, 2)
    swapped = (good[0], (Action("F", 0), Action("F", 1), Action("B", 1), Action("B", 0)))
    assert simulate(swapped).error is None
    # Stage 0 waits for B(0)'s gradient while stage 1 waits for F(1)'s activation.
    stuck = ((Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)), good[1])
    assert "deadlock" in simulate(stuck).error


@pytest.mark.parametrize("fn", [gpipe_schedule, one_f_one_b_schedule, bubble_fraction])
@pytest.mark.parametrize("P,M", [(0, 1), (1, 0), (-1, 3), (2, -2), (2.0, 2), (2, True)])
def test_bad_sizes_raise(fn, P, M):
    with pytest.raises(ShardkitError, match="must be"):
        fn(P, M)


@pytest.mark.parametrize(
    "table,fragment",
    [
        (((Action("F", 0), Action("B", 0)),), "one action list per stage"),
        (((Action("B", 0), Action("F", 0)),) * 2, "before F"),
        (((Action("F", 0), Action("F", 0), Action("B", 0)),) * 2, "twice"),
        (((Action("F", 1), Action("B", 1)),) * 2, "exactly once"),
        (((Action("X", 0),),) * 2, "bad action"),
        (
            ((Action("F", 0), Action("B", 0)), (Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1))),
            "same number",
        ),
        (((), ()), "same number"),
    ],
)
def test_validate_schedule_rejects(table, fragment):
    with pytest.raises(ShardkitError, match=fragment):
        validate_schedule(table, 2)
