"""The one cross-rank agreement (shardkit.comm.agree): every rank raises the same error naming
the failing ranks, or every rank proceeds; its collectives, as the ledger counts them."""

import pytest

from harness.helpers import rank, world_group
from shardkit import ShardkitError, ShardkitTypeError
from shardkit.comm import CommLedger
from shardkit.comm._group import resolve_group
from shardkit.comm.agree import agree, by_ranks


def _g():
    return resolve_group(world_group(), "test")


@pytest.mark.world(2)
def test_world_2_no_failure_and_the_fast_path():
    with CommLedger() as ledger:
        seen = agree(_g(), "op", None, ("a", 1))
    assert seen == [["a", 1], ["a", 1]]  # tuples come back as JSON lists, on every path
    assert ledger.count() == 1 and ledger.count(op="all_reduce", phase="check") == 1
    assert ledger.bytes_sent() == 32


@pytest.mark.world(2)
def test_world_2_one_rank_fails():
    with (
        CommLedger() as ledger,
        pytest.raises(ShardkitError, match=r"^op: 1 of 2 ranks rejected their arguments: rank 1: bad x$"),
    ):
        agree(_g(), "op", "bad x" if rank() == 1 else None)
    # the all-reduce found the error, one all-gather brought its text
    assert ledger.count(op="all_reduce") == 1 and ledger.count(op="metadata_all_gather", phase="check") == 1


@pytest.mark.world(3)
def test_world_3_two_ranks_fail_with_different_messages():
    error = {0: "too long", 2: "not a tensor"}.get(rank())
    with pytest.raises(
        ShardkitError, match=r"^op: 2 of 3 ranks rejected their arguments: rank 0: too long; rank 2: not a tensor$"
    ):
        agree(_g(), "op", error)


@pytest.mark.world(3)
def test_world_3_none_fail_payloads_gathered_and_judged():
    with CommLedger() as ledger:
        seen = agree(_g(), "op", None, rank() * 10, gather=True)
    assert seen == [0, 10, 20]
    assert ledger.count() == 2 and ledger.count(op="metadata_all_gather") == 1


@pytest.mark.world(3)
def test_world_3_payloads_that_differ_are_judged_alike_on_every_rank():
    def judge(seen):
        differ = [r for r, p in enumerate(seen) if p != seen[0]]
        return [f"ranks {differ} passed {seen[differ[0]]}, rank 0 passed {seen[0]}"] if differ else []

    shapes = "(4, 8)" if rank() == 1 else "(4, 4)"
    with pytest.raises(
        ShardkitTypeError, match=r"^op: mismatch over 3: ranks \[1\] passed \(4, 8\), rank 0 passed \(4, 4\)$"
    ):
        agree(_g(), "op", None, shapes, judge=judge, headline="mismatch over {size}", error_type=ShardkitTypeError)
    # equal payloads: one all-reduce, the judge sees every rank's, and finds nothing
    with CommLedger() as ledger:
        assert agree(_g(), "op", None, "(4, 4)", judge=judge) == ["(4, 4)"] * 3
    assert ledger.count() == 1 and ledger.count(op="all_reduce", group_size=3) == 1


@pytest.mark.world(3)
def test_world_3_same_problem_on_two_ranks_is_said_once():
    problems = ["disk full"] if rank() < 2 else ["bad key"]
    with pytest.raises(ShardkitError, match=r"^save: ranks 0, 1: disk full; rank 2: bad key$"):
        agree(_g(), "save", None, problems, judge=by_ranks, headline="")


@pytest.mark.world(2)
def test_text_with_control_characters_and_unicode_survives_the_padding():
    error = "tab\there\x00nul é" if rank() == 0 else None
    with pytest.raises(ShardkitError) as info:
        agree(_g(), "op", error, "x" * (50 if rank() else 1))
    assert str(info.value).endswith("rank 0: tab\there\x00nul é")


def test_size_one_group_needs_no_collective():
    class One:
        size, rank = 1, 0
        pg = None

    with CommLedger() as ledger:
        assert agree(One(), "op", None, (1, 2)) == [[1, 2]]
        with pytest.raises(ShardkitError, match=r"^op: 1 of 1 ranks rejected their arguments: rank 0: no$"):
            agree(One(), "op", "no")
    assert ledger.count() == 0


def test_by_ranks_groups_problems_in_rank_order():
    assert by_ranks([["a"], [], ["a", "b"]]) == ["ranks 0, 2: a", "rank 2: b"]
