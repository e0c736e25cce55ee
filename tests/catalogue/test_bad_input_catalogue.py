"""The bad-input catalogue of issue 13: every public op, bad inputs on 1 to 4 gloo ranks, both modes.

One run of the whole catalogue (tests/catalogue/bad_input_runner.py; the table of outcomes:
``python scripts/bad_input_table.py``), then its goals:

* default mode: an uneven shard passed without its sizes never aborts nor gives a wrong result;
* check mode: every case is correct or the same ShardkitError on every rank within 2 s, the
  group usable after (cases whose ranks differ in weights or inputs, not metadata, are the
  opt-in fingerprint's and only counted);
* both modes: no case hangs every rank; every valid input gives the single-process result.
  Ranks that disagree where nothing checks (the default mode passes sizes without agreeing on
  them) fail at the process-group timeout: such a case counts as a ``desync``, not a hang, only
  when a rerun with a 3 s process-group timeout shows every rank raising within it + 10 s and
  the flight recorder naming the first divergent call (``bad_input_runner._desync``).

A violation that is known and owned elsewhere is listed in ``KNOWN_OPEN`` with its reason. The
list must be exact: a case listed there that now passes fails the test too, so it shrinks as the
gaps are closed.
"""

from __future__ import annotations

import inspect
import json
import os

import pytest
from bad_input_runner import DESYNC_LIMIT, _undiagnosed, all_cases, describe, goal_failures, run_catalogue, table

import shardkit

pytestmark = pytest.mark.slow

# (case, mode) -> why it still violates a goal.
# The ranks pass different groups (a program error, not an argument): an agreement runs on the
# group each rank passed, so no message of one rank's check reaches a rank waiting on another
# group. A rank can only agree on a group it was given; guessing another (the world) would be a
# collective its peers may never call, turning a clean local error into a hang, and the design
# forbids a WORLD fallback. The ranks that wait are ended by the process-group timeout, and the
# flight recorder names their call.
_NO_COMMON_GROUP = "the ranks pass different groups: no group on which to agree (a program error, not an argument)"
KNOWN_OPEN = {
    # rank 2 passes the pair (0, 1) it is not in and raises at once; ranks 0 and 1 wait for it
    # in the world's agreement
    ("all_reduce_forward_group_not_member", "check mode"): _NO_COMMON_GROUP,
    # ranks 0 and 1 make a valid call on the pair and return; rank 2 waits for them on the world
    ("all_gather_group_size_mismatch", "check mode"): _NO_COMMON_GROUP,
    # rank 1 passes no plan, so it knows no group; rank 0 waits in the plan's group
    ("dispatch_plan_not_a_plan_one_rank_r2", "check mode"): _NO_COMMON_GROUP + " (no plan, so no group)",
}

# Every public function or layer that communicates, by the op names the cases use.
COMMUNICATING = [
    "all_reduce_forward",
    "all_reduce_backward",
    "all_gather",
    "reduce_scatter",
    "split_forward_gather_backward",
    "gather_forward_split_backward",
    "all_to_all",
    "ulysses_attention",
    "ring_attention",
    "usp_attention",
    "dispatch_plan",
    "token_dispatch",
    "token_combine",
    "send_forward",
    "recv_forward",
    "send_backward",
    "recv_backward",
    "halo_exchange",
    "spatial_conv1d",
    "spatial_conv2d",
    "spatial_conv_transpose1d",
    "spatial_max_pool",
    "spatial_avg_pool",
    "spatial_group_norm",
    "spatial_interpolate",
    "apply_tp",
    "apply_spatial",
    "parallelize",
    "vocab_parallel_cross_entropy",
]


@pytest.fixture(scope="module")
def results():
    out = run_catalogue()
    print("\n" + table(out))  # shown with -s; scripts/bad_input_table.py prints it too
    return out


def test_catalogue_size_and_coverage():
    cases = all_cases()
    assert len(cases) >= 200
    assert {c.n for c in cases} == {1, 2, 3, 4}
    ops = {part for c in cases for part in c.op.split("/")}
    assert not [name for name in COMMUNICATING if name not in ops]
    assert all(name in shardkit.__all__ or name.startswith(("send_", "recv_")) for name in COMMUNICATING)
    assert all(inspect.isfunction(getattr(shardkit, name, None)) for name in COMMUNICATING if name in shardkit.__all__)
    kinds = {c.kind for c in cases}
    assert {"control", "uneven", "shape", "dtype", "dim", "sizes", "op", "arg", "group"} <= kinds


def test_goals(results):
    failures = goal_failures(results)
    unexpected = [describe(f) for f in failures if (f[0].case.name, f[0].mode) not in KNOWN_OPEN]
    assert not unexpected, "\n".join(unexpected)
    still_open = {(f[0].case.name, f[0].mode) for f in failures}
    closed = sorted(set(KNOWN_OPEN) - still_open)
    assert not closed, f"fixed: remove from KNOWN_OPEN: {closed}"


def test_every_case_ran_in_both_modes(results):
    assert len(results) == 2 * len(all_cases())
    assert {r.mode for r in results} == {"default", "check mode"}


def _dump(directory, rank, calls):
    """A flight-recorder dump of ``rank``: ``calls`` = [(op, api, phase)] on the group [0, 1]."""
    entries = [
        dict(
            seq=i,
            group_seq=i,
            op=op,
            api=api,
            phase=phase,
            group=[0, 1],
            group_name="0",
            shape=[2],
            sizes=None,
            peer=None,
            src=None,
            dst=None,
        )
        for i, (op, api, phase) in enumerate(calls)
    ]
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "entries": entries}, f)


def test_a_hang_is_a_desync_only_when_every_rank_raised_and_the_report_names_the_call(tmp_path):
    """The classifier of a hang's rerun (``bad_input_runner._undiagnosed``) on made-up records and
    dumps: each missing piece of the proof keeps the case a hang."""
    case = next(c for c in all_cases() if c.name == "reduce_scatter_sizes_differ_across_ranks_r2")
    err = {"kind": "error", "type": "RuntimeError", "shardkit": False, "msg": "Timed out", "elapsed": 3.0}
    mine = ("reduce_scatter_single", "reduce_scatter", "forward")
    theirs = ("all_to_all_single", "reduce_scatter", "forward")
    _dump(tmp_path, 0, [mine])
    _dump(tmp_path, 1, [theirs])
    assert _undiagnosed(case, {0: err, 1: err}, str(tmp_path)) is None
    returned = {"kind": "ok", "match": False, "elapsed": 0.1}
    assert "did not raise" in _undiagnosed(case, {0: err, 1: returned}, str(tmp_path))
    assert "did not raise" in _undiagnosed(case, {0: err}, str(tmp_path))  # rank 1 never reported
    assert "did not raise" in _undiagnosed(case, {0: err, 1: dict(err, elapsed=DESYNC_LIMIT + 1)}, str(tmp_path))
    _dump(tmp_path, 1, [mine])  # the records agree: nothing named
    assert "no divergence" in _undiagnosed(case, {0: err, 1: err}, str(tmp_path))
    _dump(tmp_path, 1, [("all_reduce", "all_reduce_forward", "forward")])
    _dump(tmp_path, 0, [("all_gather_single", "all_gather", "forward")])  # another api than the case's
    assert "does not name the call" in _undiagnosed(case, {0: err, 1: err}, str(tmp_path))
    os.remove(tmp_path / "rank1.json")
    assert "dumps of ranks [0] only" in _undiagnosed(case, {0: err, 1: err}, str(tmp_path))
