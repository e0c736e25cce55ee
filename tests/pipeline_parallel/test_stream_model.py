"""The chunked runner on NCCL without a GPU: its own posting order (the mailbox of every rank,
recorded) on the stream model of :mod:`harness.stream_model`, for every table
of SCHEDULES with p in 2..8, v in 1..4 (as the schedule allows) and m in {p, 2p, 2p + 1}; and for
stages made of tp groups of their own sizes (``--pp-tp``), at the level of their ranks."""

import pytest

from harness.stream_model import check_streams, posting_order, tp_posting_order
from shardkit.errors import ShardkitError
from shardkit.pipeline_parallel._mailbox import link, links
from shardkit.pipeline_parallel.tables import SCHEDULES, schedule_table


def _tables():
    for name, spec in SCHEDULES.items():
        for p in range(2, 9):
            for v in range(spec.v_min, min(spec.v_max or 4, 4) + 1):
                for m in (p, 2 * p, 2 * p + 1):
                    try:
                        table = spec.build(p, v, m)
                    except ShardkitError:  # sizes the schedule refuses
                        continue
                    yield (name, p, v, m), table, spec.placement


def test_every_table_runs_to_its_end_on_nccl_streams_with_one_group_per_link():
    """The NCCL order (receives posted when a step needs them), one process group per link:
    no deadlock and no wrong pairing, with one stream per rank pair or per rank (eager init)."""
    failures, n = [], 0
    for case, table, placement in _tables():
        events = posting_order(table, placement=placement, v=case[2], early=False)
        n += 1
        for granularity in ("pair", "rank"):
            if (error := check_streams(events, granularity)) is not None:
                failures.append((case, granularity, error[:200]))
    assert n > 200 and not failures, failures[:3]


def test_gloo_order_with_early_receives_runs_to_its_end():
    """The gloo order (each neighbour's next receive posted as soon as the last one completed)
    on one group, with gloo's matching (each direction of a pair on its own)."""
    failures = [
        case
        for case, table, placement in _tables()
        if check_streams(posting_order(table, placement=placement, v=case[2], early=True, shared=True), "gloo")
    ]
    assert not failures, failures[:3]


def test_one_group_for_both_directions_deadlocks_on_nccl_streams():
    """The same check with one group (what the runner did before: NCCL was refused) finds the
    deadlock: a send to a neighbour waits in front of a receive from it, on every schedule but
    GPipe (all forwards, then all backwards: no send waits in front of a receive)."""
    table = schedule_table("1f1b", 4, 1, 8)
    error = check_streams(posting_order(table, placement="looped", v=1, early=False, shared=True), "pair")
    assert error is not None and error.startswith("deadlock")
    stuck = {
        case[0]
        for case, table, placement in _tables()
        if case[1] <= 4
        and check_streams(posting_order(table, placement=placement, v=case[2], early=False, shared=True), "pair")
    }
    assert stuck == set(SCHEDULES) - {"gpipe"}


def test_receives_posted_out_of_the_senders_order_pair_the_wrong_messages():
    """zbv at p = 2, m = 4 needs messages in another order than they are sent; a receiver that
    posted in its own order would mix tensors, and the check says so."""
    events = posting_order(schedule_table("zbv", 2, 2, 4), placement="v", v=2, early=False)
    posts = [i for i, e in enumerate(events[0]) if e[0] == "post"]
    i, j = posts[0], next(k for k in posts[1:] if events[0][k][3] == events[0][posts[0]][3])
    row = list(events[0])
    row[i], row[j] = (*row[i][:1], row[j][1], *row[i][2:]), (*row[j][:1], row[i][1], *row[j][2:])
    error = check_streams([row, events[1]], "pair")
    assert error is not None and error.startswith("wrong pairing")


@pytest.mark.parametrize("p", range(2, 9))
def test_no_two_links_of_a_group_share_a_rank(p):
    """Each link's group carries one rank pair's messages one way: the edges mapped to a link
    share no rank, so a stream per rank (eager NCCL) still holds one pair, one way."""
    edges = {(r, q) for r in range(p) for q in ((r + 1) % p, (r - 1) % p) if q != r}
    by_link: dict = {}
    for src, dst in edges:
        by_link.setdefault(link(src, dst, p), []).append((src, dst))
    assert sorted(by_link) == links(p)
    for name, pairs in by_link.items():
        ends = [r for pair in pairs for r in pair]
        assert len(ends) == len(set(ends)), (name, pairs)
    assert len(links(p)) == (2 if p == 2 else 4 if p % 2 == 0 else 6)


def test_check_streams_refuses_an_unknown_granularity():
    with pytest.raises(ShardkitError, match="granularity must be"):
        check_streams([[("end",)]], "stream")


# stages of tp groups (--pp-tp, StageGroups): stage -> its ranks, leader first
TP_STAGES = [
    [[0, 1], [2], [3]],
    [[0], [1, 2]],
    [[0, 1], [2, 3]],
    [[0], [1, 2], [3, 4, 5]],
    [[0, 1, 2], [3], [4, 5], [6]],
]
ONE_CHUNK = [name for name, spec in SCHEDULES.items() if spec.placement == "looped" and spec.v_min == 1]


def _tp_events(name, stage_ranks, m, shared=False):
    table = schedule_table(name, len(stage_ranks), 1, m)
    stage_events = posting_order(table, placement="looped", v=1, early=False, shared=shared)
    return tp_posting_order(stage_events, stage_ranks)


def test_tp_group_stages_run_to_their_end_on_nccl_streams_with_one_group_per_link():
    """--pp-tp: each stage message as the reshard transport posts it on every rank (header leader
    to leader, a piece per rank pair, the broadcasts in the receiving stage), one group per link
    over the replica: no deadlock and no wrong pairing, per rank pair or per rank (eager)."""
    assert {"1f1b", "gpipe", "zb-h1"} <= set(ONE_CHUNK)
    failures, n = [], 0
    for name in ONE_CHUNK:
        for stage_ranks in TP_STAGES:
            for m in (len(stage_ranks), 2 * len(stage_ranks) + 1):
                events = _tp_events(name, stage_ranks, m)
                n += 1
                for granularity in ("pair", "rank"):
                    if (error := check_streams(events, granularity)) is not None:
                        failures.append((name, stage_ranks, m, granularity, error[:200]))
    assert n >= 30 and not failures, failures[:3]


def test_tp_group_stages_on_one_group_deadlock_on_nccl_streams():
    """The rank-level model can fail: with one group for both directions the runner's own order
    deadlocks under 1F1B on these stages, as on one-rank stages (GPipe does not)."""
    error = check_streams(_tp_events("1f1b", [[0, 1], [2], [3]], 8, shared=True), "pair")
    assert error is not None and error.startswith("deadlock")
    assert check_streams(_tp_events("gpipe", [[0, 1], [2], [3]], 8, shared=True), "pair") is None
