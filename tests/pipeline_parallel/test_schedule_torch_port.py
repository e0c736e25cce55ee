"""Cases of PyTorch's own pipeline-schedule tests, carried over to shardkit's tables (facts, not code).

Ported from ``test/distributed/pipelining/test_schedule.py`` (``TestSchedulePlan``,
``TestScheduleLowering``) and its schedule zoo ``schedule_registry.py`` (used by
``test_schedule_multiproc.py``):

* ``test_pipeline_order`` (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble): its ``(num_local_stages,
  num_microbatches, group_size)`` cases; every table must be complete and run without deadlock in
  :func:`simulate_steps` (PyTorch skips ``m % p != 0``: here interleaved refuses it, looped BFS
  runs it). Interleaved zero bubble: rank ``r`` runs ``min((v - 1) k + p - 1 - r, v m)``
  warm-up forwards (``k`` microbatches a round), then alternates F and I, and its ``W`` s lag
  its ``I`` s by ``r`` steps (torch's ``num_1f1b_microbatches = rank``).
* ``test_pipeline_order_flex_and_zero_bubble``: its warm-up count of the interleaved schedule,
  ``min((v - 1) p + 2(p - 1), v m)`` forwards on rank 0 (then the steady phase's first forward).
* ``test_pipeline_order_for_v_schedules`` (ZBVZeroBubble, DualPipeV): ``v != 2`` is refused
  (a ``ValueError`` there and here: ``ShardkitError`` is one), DualPipeV refuses
  ``m < 2p`` (its ``num_stages``), every other case is valid.
* ``schedule_registry.py``'s hand-written ``ScheduleVShaped`` (V placement, one microbatch) and
  ``ScheduleWithW`` (looped placement, ``I``/``W``, two microbatches), and the compute
  schedules of ``test_send_recv`` (``simple_2_rank_2_stage``, ``v_2_rank_4_stage``): here they
  run without deadlock and, at unit costs, take the number of time steps their grids draw.

Not ported here: ``ScheduleUnbalanced`` (3 and 2 chunks on two ranks: neither looped nor V
placement; it runs padded to ``v = 3`` looped chunks, ``test_unbalanced_stages.py``);
``test_csv_compare`` (compares against PyTorch's own CSV artifact of DualPipeV:
that is their implementation's exact order, not a property; copying it is out of bounds);
``test_action_parse`` and the lowering passes (``_add_unshard_reshard``, ``_add_reduce_grad``,
``_merge_bw``, ``_add_send_recv``'s comm order): they test PyTorch's string format and runtime
lowering, which shardkit's tables do not have (one runner executes every table's steps);
the multi-process runs of ``test_schedule_multiproc.py`` (runtime parity, not tables: ported in
``test_torch_multiproc_port.py``; the stage-level I/W parity is ``test_schedule_split_backward.py``).
"""

import pytest

from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel.simulate import simulate_steps
from shardkit.pipeline_parallel.steps import Step
from shardkit.pipeline_parallel.tables import SCHEDULES, schedule_table

# (num_local_stages v, num_microbatches m, group_size p), as in TestSchedulePlan
TORCH_CASES = [
    (2, 2, 2), (2, 4, 4), (2, 8, 2), (2, 8, 4), (2, 8, 8), (4, 4, 4), (4, 8, 4), (4, 8, 8),
    (4, 16, 4), (4, 32, 4), (4, 64, 4), (4, 16, 16), (4, 32, 32), (4, 128, 64),
    (3, 2, 2), (3, 8, 2), (3, 12, 4), (4, 6, 3), (4, 10, 5),
    (2, 3, 4), (2, 4, 4), (2, 10, 4), (2, 15, 4),
]  # fmt: skip
UNIT = {"F": 1.0, "B": 1.0, "I": 1.0, "W": 1.0}  # one time step per action, as PyTorch's grids


def _sim(name, table, v, m, costs=None):
    kw = {} if costs is None else {"costs": costs}
    return simulate_steps(table, placement=SCHEDULES[name].placement, v=v, num_microbatches=m, **kw)


@pytest.mark.parametrize("name", ["interleaved-1f1b", "looped-bfs", "interleaved-zb"])
@pytest.mark.parametrize(("v", "m", "p"), TORCH_CASES)
def test_pipeline_order(name, v, m, p):
    if m % p and name == "interleaved-1f1b":  # PyTorch's test skips these; here they are refused
        with pytest.raises(ShardkitError, match=f"multiple of p={p}|must be >= {p}"):
            schedule_table(name, p, v, m)
        return
    table = schedule_table(name, p, v, m)
    rep = _sim(name, table, v, m)
    assert rep.error is None, rep.error
    if name == "interleaved-1f1b":
        warmup = min((v - 1) * p + 2 * (p - 1), v * m)  # PyTorch's count for rank 0
        leading = next(i for i, s in enumerate(table[0]) if s.kind != "F")
        assert leading == min(warmup + 1, v * m)  # the steady phase starts with one more forward
    if name == "interleaved-zb":
        k = m // max(1, m // p)
        for r, row in enumerate(table):
            warmup = min((v - 1) * k + p - 1 - r, v * m)
            assert [s.kind for s in row[:warmup]] == ["F"] * warmup and row[warmup].kind in ("F", "I")
            inputs = [i for i, s in enumerate(row) if s.kind == "I"]
            weights = [i for i, s in enumerate(row) if s.kind == "W"]
            lag = sum(i < weights[0] for i in inputs)  # I steps before the first W
            assert lag == min(r + 1, v * m), (r, lag)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize(("v", "m", "p"), TORCH_CASES)
def test_pipeline_order_for_v_schedules(name, v, m, p):
    if v != 2:
        with pytest.raises(ValueError, match=f"must be 2, got {v}"):
            schedule_table(name, p, v, m)
        return
    if name == "dualpipev" and m < 2 * p:
        with pytest.raises(ShardkitError, match=f"must be >= {2 * p}"):
            schedule_table(name, p, v, m)
        return
    assert _sim(name, schedule_table(name, p, v, m), v, m).error is None


def _steps(text: str) -> tuple[Step, ...]:
    """``"F0.1 I1.0"``: kind, microbatch '.' local chunk."""
    return tuple(Step(w[0], int(w[1 : w.index(".")]), int(w[w.index(".") + 1 :])) for w in text.split())


# (placement schedule, v, m, rows, time steps of PyTorch's grid)
HAND_TABLES = {
    # ScheduleVShaped: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2; one microbatch
    "v_shaped": ("zbv", 2, 1, ("F0.0 F0.1 B0.1 B0.0", "F0.0 F0.1 B0.1 B0.0"), 8),
    # ScheduleWithW: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; I and W split
    "with_w": (
        "interleaved-1f1b",
        2,
        2,
        (
            "F0.0 F1.0 F0.1 F1.1 I0.1 W0.1 I0.0 I1.1 W0.0 I1.0 W1.1 W1.0",
            "F0.0 F1.0 F0.1 I0.1 F1.1 I0.0 I1.1 W0.1 I1.0 W0.0 W1.1 W1.0",
        ),
        13,
    ),
    # test_send_recv "simple_2_rank_2_stage"
    "simple_2_rank_2_stage": ("1f1b", 1, 2, ("F0.0 F1.0 B0.0 B1.0", "F0.0 B0.0 F1.0 B1.0"), 6),
    # test_send_recv "v_2_rank_4_stage" (its B followed by W is an input-gradient step)
    "v_2_rank_4_stage": (
        "zbv",
        2,
        2,
        (
            "F0.0 F1.0 F0.1 I0.1 F1.1 I1.1 I0.0 W0.1 I1.0 W1.1 W0.0 W1.0",
            "F0.0 F0.1 F1.0 F1.1 I0.1 I0.0 I1.1 I1.0 W0.1 W1.1 W0.0 W1.0",
        ),
        13,
    ),
}


@pytest.mark.parametrize("case", sorted(HAND_TABLES))
def test_hand_written_tables_run_in_the_steps_their_grids_draw(case):
    name, v, m, rows, steps = HAND_TABLES[case]
    rep = _sim(name, tuple(_steps(r) for r in rows), v, m, UNIT)
    assert rep.error is None, rep.error
    assert rep.makespan == steps


def test_a_hand_table_with_its_backwards_swapped_deadlocks():
    name, v, m, rows, _ = HAND_TABLES["v_shaped"]
    broken = (_steps(rows[0]), _steps("F0.0 F0.1 B0.0 B0.1"))  # stage 1's backward before stage 2's
    rep = _sim(name, broken, v, m, UNIT)
    assert rep.error is not None and rep.error.startswith("deadlock")
